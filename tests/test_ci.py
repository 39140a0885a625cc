"""The test run itself: what tests/conftest.py sets up for CI's runs."""

import pytest


@pytest.fixture(scope="module")
def built_once():
    return object()


def test_tests_sharing_a_module_fixture_share_a_worker(request, built_once):
    """Under `--dist loadgroup` (pyproject.toml's addopts), pytest-xdist sends the
    tests that share a module fixture to one worker, which builds it once: it
    names each such test `<node id>@<its group>`. pytest-xdist 3.8 does so by
    rewriting `item._nodeid`, which pytest 9 no longer reads (hence the pin of
    pytest in pyproject.toml): there, every worker built every shared fixture."""
    (group,) = request.node.iter_markers("xdist_group")
    assert group.args == ("tests/test_ci.py",)  # tests/conftest.py marks it
    if getattr(request.config.option, "loadgroup", False):  # a worker of xdist's
        assert request.node.nodeid.endswith("@tests/test_ci.py"), (
            f"{request.node.nodeid}: pytest-xdist did not group it; pytest "
            f"{pytest.__version__} and this pytest-xdist do not work together"
        )
