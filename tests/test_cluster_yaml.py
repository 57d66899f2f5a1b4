"""cluster.yaml is a valid Ray cluster-launcher config, checked the way `ray up` checks it before
it talks to the cloud (Ray's own ray-schema.json, then prepare_config + validate_config), and it
says what README promises: a non-preemptible head, spot GPU workers, raygpt installed on every
node, the same Ray as this checkout, the run directory on cloud storage. Nothing is launched."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def test_validates_against_rays_own_schema(config, schema):
    jsonschema.validate(config, schema)  # the file as written, before any defaults fill it
    validate_config(copy.deepcopy(config))
    prepared = prepare_config(copy.deepcopy(config))  # what `ray up` validates
    validate_config(prepared)
    assert prepared["head_node_type"] == "head"


def test_the_schema_check_would_catch_a_mistake(config, schema):
    typo = copy.deepcopy(config)
    typo["setup_command"] = typo.pop("setup_commands")
    with pytest.raises(jsonschema.ValidationError, match="setup_command"):
        validate_config(typo)
    bad = copy.deepcopy(config)
    bad["available_node_types"]["gpu_spot"]["resources"] = {"GPU": -1}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_head_and_spot_gpu_workers(config):
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}  # nothing is scheduled on the head
    assert "InstanceMarketOptions" not in head["node_config"]  # the head is never preempted
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert workers and all(w["min_workers"] >= 1 for w in workers)
    assert any(w["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"
               for w in workers)
    assert any(re.match(r"(p4d|p4de|p5|p5e|p5en|g5|g6|g6e)\.", w["node_config"]["InstanceType"])
               for w in workers)
    assert config["max_workers"] >= sum(w["max_workers"] for w in workers)


def test_nodes_run_this_ray_and_install_raygpt(config):
    image = config["docker"]["image"]
    assert image.startswith(f"rayproject/ray:{ray.__version__}-py3"), image
    assert image.endswith("-gpu")
    assert config["file_mounts"]["~/raygpt"] == "."
    assert any(re.search(r'pip install .*-e "\$HOME/raygpt\[', c) for c in config["setup_commands"])
    assert any("import raygpt" in c for c in config["setup_commands"])


def test_every_command_is_valid_shell(config):
    keys = ("initialization_commands", "setup_commands", "head_setup_commands",
            "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")
    commands = [c for k in keys for c in config.get(k, [])]
    assert len(commands) >= 6
    for c in commands:
        r = subprocess.run(["bash", "-n", "-c", c], capture_output=True, text=True)
        assert r.returncode == 0, f"{c!r}: {r.stderr}"


def test_run_directory_on_cloud_storage_and_clean_job_stop(config):
    text = (ROOT / "cluster.yaml").read_text()
    assert re.search(r"RAYGPT_RUN_DIR=s3://", text)
    assert re.search(r"-o s3://", text)  # the documented job writes its run directory there
    head_start = " ".join(config["head_start_ray_commands"])
    wait = re.search(r"RAY_JOB_STOP_WAIT_TIME_S=(\d+) ray start --head", head_start)
    assert wait and int(wait.group(1)) >= 60  # room for the final checkpoint on `ray job stop`


def test_readme_documents_the_cluster(config):
    readme = (ROOT / "README.md").read_text()
    assert "ray up cluster.yaml" in readme
    assert "ray job submit" in readme and "raygpt status" in readme and "raygpt plot" in readme


# ---------------------------------------------------------------------- closed by default

TOKEN_DIR = "~/raygpt-cluster-auth"


def test_token_authentication_on_every_node(config):
    """`ray start` enables token auth only when RAY_AUTH_MODE=token is set: both start commands
    set it and name the token file that file_mounts copies to every node; every shell (job
    drivers) gets the same two variables; setup fails loudly without a token."""
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts, key
        for c in starts:
            assert re.search(r"\bRAY_AUTH_MODE=token\b[^;]*\bray start\b", c), c
            assert re.search(r"RAY_AUTH_TOKEN_PATH=\$HOME/raygpt-cluster-auth/auth_token\b[^;]*"
                             r"\bray start\b", c), c
    mounts = config["file_mounts"]
    assert mounts[TOKEN_DIR] == "~/.raygpt-cluster-auth"  # a directory mount, outside the repo
    assert not mounts[TOKEN_DIR].startswith(".")
    setup = " ; ".join(config["setup_commands"])
    assert "test -s ~/raygpt-cluster-auth/auth_token" in setup and "exit 1" in setup
    assert "chmod 700 ~/raygpt-cluster-auth" in setup and "chmod 600" in setup
    assert "export RAY_AUTH_MODE=token" in setup
    assert "export RAY_AUTH_TOKEN_PATH=$HOME/raygpt-cluster-auth/auth_token" in setup
    text = (ROOT / "cluster.yaml").read_text()
    assert "ray get-auth-token --generate" in text and "RAY_AUTH_MODE=token ray job submit" in text
    assert not re.search(r"RAY_AUTH_MODE=disabled", text)


def test_dashboard_only_on_localhost(config):
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head
    text = (ROOT / "cluster.yaml").read_text()
    assert "0.0.0.0" not in text  # no service of the cluster bound to every interface
    assert "ray dashboard cluster.yaml" in text  # the SSH tunnel is the way in


def _policy(name: str) -> dict:
    return json.loads((ROOT / "iam" / name).read_text())


def test_workers_role_limited_to_the_run_bucket_prefix(config):
    """The GPU workers' instance profile is raygpt's own, whose whole policy reaches only
    objects under the run bucket's raygpt/ prefix (where RAYGPT_RUN_DIR points) and a listing
    of that prefix: no wildcard action, no other bucket, no EC2 or IAM."""
    types = config["available_node_types"]
    for name, t in types.items():
        if name == config["head_node_type"]:
            continue
        profile = t["node_config"]["IamInstanceProfile"]["Name"]
        assert profile == "raygpt-worker" and profile != "ray-autoscaler-v1"
    text = (ROOT / "cluster.yaml").read_text()
    run_dir = re.search(r"RAYGPT_RUN_DIR=s3://([^/\s']+)/([^/\s']+)/", text)
    bucket, prefix = run_dir.group(1), run_dir.group(2)
    policy = _policy("worker-s3-policy.json")
    assert policy["Version"] == "2012-10-17"
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow"
        actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        assert all(a.startswith("s3:") and "*" not in a for a in actions), actions
        resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
        for r in resources:
            if actions == ["s3:ListBucket"]:
                assert r == f"arn:aws:s3:::{bucket}"
                prefixes = st["Condition"]["StringLike"]["s3:prefix"]
                assert all(p in (prefix, f"{prefix}/*") for p in prefixes)
            else:
                assert r == f"arn:aws:s3:::{bucket}/{prefix}/*"
                assert not {"s3:ListBucket", "s3:PutBucketPolicy"} & set(actions)
    passrole = _policy("head-passrole-policy.json")["Statement"]
    assert [s["Action"] for s in passrole] == ["iam:PassRole"]
    assert all(s["Resource"].endswith(":role/raygpt-worker") for s in passrole)
    assert "iam/worker-s3-policy.json" in text


def test_security_page_says_what_is_closed_by_default():
    page = (ROOT / "docs" / "security.md").read_text()
    section = page.split("## What is exposed", 1)[1].split("\n## ", 1)[0]
    for must in ("RAY_AUTH_MODE=token", "127.0.0.1", "ray dashboard cluster.yaml",
                 "iam/worker-s3-policy.json", "--allow-fault-injection", "--overwrite"):
        assert must in section, must
