"""The line that refuses a local directory some nodes of a cluster do not see (the probe itself
runs on a real three-node cluster in test_node_loss.py)."""

from raygpt.ray.shared_dir import blind_nodes_line


def test_a_directory_every_node_sees_is_not_refused():
    assert blind_nodes_line("-o", "/data/out", [], 4) is None


def test_blind_nodes_are_named_in_one_line_with_the_way_out():
    line = blind_nodes_line("-o", "/data/out", ["10.0.0.7 (ab12cd34)"], 4)
    assert line == ("-o /data/out: expected a directory every node of the Ray cluster sees (a "
                    "shared filesystem such as NFS) or an s3:// / gs:// URI; 1 of 4 nodes do not "
                    "see it: 10.0.0.7 (ab12cd34)")
    many = blind_nodes_line("-o", "/d", [f"10.0.0.{i}" for i in range(5)], 6)
    assert "5 of 6 nodes" in many and many.endswith("10.0.0.0, 10.0.0.1, 10.0.0.2 ...")
    assert "\n" not in many
