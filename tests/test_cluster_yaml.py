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
    assert config["file_mounts"] == {"~/raygpt": "."}
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
