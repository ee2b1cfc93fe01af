"""fixtures/tiers.py: the markers kept true. Each test runs a session of its own (pytester) with the tiers'
plugin, whose tests try to start what their markers do not say; nothing is started: the launches are refused,
or name programs that do not exist."""

from __future__ import annotations

import pytest

from fixtures.tiers import starts_ranks

# The inner session's conftest: the plugin as tests/conftest.py registers it, and a home of each test's own.
CONFTEST = """
import pytest

from fixtures import tiers


def pytest_addoption(parser):
    tiers.add_option(parser)


def pytest_configure(config):
    tiers.register(config)


def pytest_unconfigure(config):
    tiers.unregister(config)


@pytest.fixture(autouse=True)
def own_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXPIPE_HOME", str(tmp_path / "mlxpipe"))
"""
LAUNCH = "/nonexistent/mlx.launch"  # were it ever started, the test would fail on a missing file instead


@pytest.mark.parametrize(
    ("argv", "starts"),
    [
        ([".venv/bin/mlx.launch", "--hostfile", "h.json", "--", "python", "-m", "mlxpipe.worker"], True),
        (["python", "-m", "mlxpipe.worker", "--links", "2"], True),
        ("/usr/bin/mlx.launch --verbose", True),
        (["python", "-m", "mlxpipe.launch.mlx_launch", "--hostfile", "h.json", "--", "python", "-c", "x"], True),
        (["python", "-m", "mlxpipe.launch.supervisor", "--", "-c", "print()"], False),  # no worker: no rank
        (["mlxpipe", "plan", "--model", "m"], False),
        (["python", "-c", "import mlxpipe.worker"], False),
    ],
)
def test_what_starts_ranks(argv: list[str] | str, starts: bool) -> None:
    assert starts_ranks(argv) is starts


def test_a_test_that_starts_ranks_unmarked_fails_and_starts_nothing(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(f"""
        import os
        import subprocess
        from pathlib import Path

        import pytest

        from fixtures import tiers


        def test_launch():
            subprocess.Popen([{LAUNCH!r}, "--hostfile", "h.json"])


        def test_worker():
            subprocess.run(["python3", "-m", "mlxpipe.worker", "--job", "J"])


        def test_launch_caught():
            try:
                subprocess.run([{LAUNCH!r}])
            except BaseException:
                pass


        def test_a_child_launched():
            run = Path(os.environ["MLXPIPE_HOME"]) / "runs" / "r1"
            run.mkdir(parents=True)
            (run / "command.txt").write_text("mlx.launch\\n")


        @pytest.fixture(scope="module")
        def ranks():
            tiers.require_marker(tiers.RANKS, "starts a server")


        @pytest.mark.ranks
        def test_marked_starts_the_fixture(ranks):
            pass


        def test_unmarked_uses_it(ranks):
            pass


        def test_plain_processes_are_fine():
            assert subprocess.run(["true"]).returncode == 0


        @pytest.fixture(scope="module")
        def remote_ranks():
            tiers.require_marker(tiers.RANKS, "starts remote ranks")


        @pytest.fixture
        def site(request):
            # A test's own fixture that sets up a shared one for one parameter only (as test_failures.py's).
            if request.param == "remote":
                request.getfixturevalue("remote_ranks")
            return request.param


        @pytest.mark.parametrize("site", [pytest.param("remote", marks=pytest.mark.ranks), "local"], indirect=True)
        def test_local_after_remote(site):
            pass
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=5, failed=3, errors=2)  # the child's launch: found at teardown
    result.stdout.fnmatch_lines_random([
        "*test_launch starts ranks (/nonexistent/mlx.launch --hostfile h.json ...) but is not marked ranks*",
        "*test_worker starts ranks (python3 -m mlxpipe.worker ...) but is not marked ranks*",
        "*test_launch_caught starts ranks (/nonexistent/mlx.launch ...) but is not marked ranks*",
        "*test_a_child_launched launched ranks (in a process it started: *) but is not marked ranks*",
        "*test_unmarked_uses_it uses ranks, which starts MLX ranks, but is not marked ranks*",
    ])
    assert "No such file" not in result.stdout.str()  # refused before anything started


def test_a_test_using_a_fixture_that_starts_ranks_or_the_cluster_stops_the_session(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST + "\nfrom fixtures.cluster import cluster, cluster_session\n"
                                      "from fixtures.serve_process import server\n")
    pytester.makepyfile("""
        import pytest


        def test_server(server):
            pass


        @pytest.mark.ranks
        def test_cluster(cluster):
            pass


        @pytest.mark.ranks
        @pytest.mark.cluster
        def test_both(server, cluster):
            pass
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "*tests whose fixtures start what their markers do not say*",
        "*::test_server: uses server (starts MLX ranks); add @pytest.mark.ranks",
        "*::test_cluster: uses cluster, cluster_session (builds the ssh test cluster); add @pytest.mark.cluster",
    ])
    assert "test_both" not in result.stderr.str()


def test_check_tiers_names_the_marked_tests_that_start_nothing(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile("""
        import pytest

        from fixtures import tiers


        @pytest.mark.ranks
        def test_starts():
            tiers.require_marker(tiers.RANKS, "starts a server")


        @pytest.mark.ranks
        def test_idle():
            pass


        @pytest.mark.cluster
        def test_idle_cluster():
            pass


        @pytest.mark.ranks
        def test_skipped():
            pytest.skip("no npm")
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--check-tiers")
    result.assert_outcomes(passed=3, skipped=1)
    result.stdout.fnmatch_lines([
        "*tiers (--check-tiers)*",
        "*::test_idle: marked ranks, but started no rank",
        "*::test_idle_cluster: marked cluster, but used no cluster",
    ])
    assert "test_starts:" not in result.stdout.str() and "test_skipped:" not in result.stdout.str()
