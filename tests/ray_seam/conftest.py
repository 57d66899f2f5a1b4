"""What the Ray seam's test modules share."""

import pytest
import ray


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray of 2 CPUs for the whole module (each module its own: never a stranger's)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
