"""The Dagster UI in a real browser: `dagster dev` on a persistent instance, driven by Chromium.

Steps (screenshots under ``test-artifacts/ui/``):

1. The tiny pipeline is materialized through ``capability_spec`` (every capability partition) into
   a temporary ``DAGSTER_HOME`` holding a copy of the repo's ``dagster.yaml``.
2. ``dagster dev -w workspace.yaml`` serves that instance (``TRACE_PROFILE=tiny``), in its own
   process group, which is killed at the end whatever happens.
3. The global asset lineage shows every asset of ``build_definitions(TINY)`` once its groups are
   expanded (``01_asset_graph.png``).
4. ``task_splits`` is materialized by clicking "Materialize" on its page; the run is followed from
   the "Launched run" toast to its page until it succeeds (``02_run_success.png``).
5. The asset page shows that run's metadata: ``n_train`` and the ``by_family`` table
   (``03_asset_metadata.png``).
6. A ``capability_spec`` partition page shows the capability's lineage metadata: the
   ``justification`` (Δ, coverage, example failed trajectories) and the selection ``thresholds``
   (``04_capability_partition.png``).

Chromium is Debian's (``.ci/run`` installs it); Playwright downloads nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from trace_assets import paths

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = paths.REPO_ROOT / "test-artifacts" / "ui"
DAGSTER = Path(sys.executable).parent / "dagster"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--no-first-run", "--disable-dev-shm-usage",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                       "(`apt-get install chromium`; .ci/run installs it)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prematerialize(home: Path, data: Path) -> tuple[list[str], set[str]]:
    """The tiny pipeline through capability_spec into the instance at ``home``. Returns the
    capability partitions and the names of every asset of the graph."""
    from dagster import AssetKey, DagsterInstance

    from trace_assets.definitions import MAIN_JOB, build_definitions
    from trace_assets.settings import TINY

    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("TRACE_DATA_DIR", str(data))
        mp.setenv("TRACE_DAGSTER_DIR", str(data / "dagster"))
        defs = build_definitions(TINY)
        graph = defs.resolve_asset_graph()
        spec = AssetKey("capability_spec")
        upstream = sorted(
            k for k in graph.get_ancestor_asset_keys(spec)
            if k != spec and graph.get(k).is_materializable and graph.get(k).partitions_def is None
        )
        job = defs.resolve_job_def(MAIN_JOB)
        with DagsterInstance.from_config(str(home)) as instance:
            assert job.execute_in_process(instance=instance, asset_selection=upstream).success
            partitions = instance.get_dynamic_partitions("capability")
            for pk in partitions:
                assert job.execute_in_process(instance=instance, asset_selection=[spec], partition_key=pk).success
        return list(partitions), {k.to_user_string() for k in graph.get_all_asset_keys()}
    finally:
        mp.undo()


def _kill_group(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the server's process group, then SIGKILL it (dagster dev may ignore SIGTERM).

    ``start_new_session=True`` made the server the leader of its own group: pgid == pid, which
    stays valid even after the leader itself has exited and left children behind.
    """
    pgid = proc.pid
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.3)
        if not _group_alive(pgid):
            break
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group is alive (zombies do not count)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class Server:
    def __init__(self, url: str, home: Path, partitions: list[str], assets: set[str]):
        self.url, self.home, self.partitions, self.assets = url, home, partitions, assets

    def gql(self, query: str, variables: dict | None = None) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(f"{self.url}/graphql", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            out = json.load(resp)
        assert "errors" not in out, out
        return out["data"]

    def runs(self, limit: int = 20) -> list[dict]:
        data = self.gql(
            "query($limit: Int) { runsOrError(limit: $limit) { ... on Runs { results { "
            "runId status jobName assetSelection { path } } } } }", {"limit": limit})
        return data["runsOrError"]["results"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    models = os.environ.get("TRACE_MODELS_DIR") or str(paths.models_dir())  # before TRACE_DATA_DIR moves
    root = tmp_path_factory.mktemp("ui")
    home, data = root / "home", root / "data"
    home.mkdir()
    shutil.copy(paths.REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob("*.png"):
        old.unlink()
    partitions, assets = _prematerialize(home, data)

    port = _free_port()
    env = {
        **os.environ, "DAGSTER_HOME": str(home), "TRACE_DATA_DIR": str(data), "TRACE_DAGSTER_DIR": str(data / "dagster"),
        "TRACE_PROFILE": "tiny", "TRACE_MODELS_DIR": models, "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
    }
    log = (ARTIFACTS / "dagster-dev.log").open("w")
    proc = subprocess.Popen(
        [str(DAGSTER), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
        cwd=paths.REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_up(url, proc)
        srv = Server(url, home, partitions, assets)
        _wait_for_location(srv)
        yield srv
    finally:
        _kill_group(proc)
        log.close()
        assert not _group_alive(proc.pid), f"processes of dagster dev's group {proc.pid} survived SIGKILL"


def _wait_until_up(url: str, proc: subprocess.Popen, timeout: float = 150.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"dagster dev exited with {proc.returncode}; see {ARTIFACTS / 'dagster-dev.log'}")
        try:
            with urllib.request.urlopen(f"{url}/server_info", timeout=5) as resp:
                if resp.status == 200 and "dagster_version" in json.load(resp):
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"dagster dev did not answer /server_info within {timeout:.0f} s")


def _wait_for_location(srv: Server, timeout: float = 120.0) -> None:
    query = ("{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus "
             "locationOrLoadError { __typename ... on PythonError { message } } } } } }")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entries = srv.gql(query)["workspaceOrError"]["locationEntries"]
        if entries and all(e["loadStatus"] == "LOADED" for e in entries):
            errors = [e["locationOrLoadError"] for e in entries if e["locationOrLoadError"]["__typename"] != "RepositoryLocation"]
            assert not errors, errors
            return
        time.sleep(1)
    pytest.fail("the code location did not load")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    context.set_default_timeout(60_000)
    page = context.new_page()
    # The first-load "Join the Dagster community" modal covers the page: Skip it whenever it shows.
    page.add_locator_handler(page.get_by_role("button", name="Skip", exact=True), lambda button: button.click())
    try:
        yield page
    finally:
        context.close()


def _node_matches(name: str, shown: str) -> bool:
    """The graph abbreviates long names in its zoomed-out view: ``capabi…_dictionary``."""
    if "…" in shown:
        head, _, tail = shown.partition("…")
        return name.startswith(head) and name.endswith(tail) and len(head) + len(tail) < len(name)
    return shown == name


def test_ui_graph_materialize_and_metadata(server, page):
    try:
        _walk_the_ui(server, page)
    except BaseException:
        page.screenshot(path=str(ARTIFACTS / "failed.png"), full_page=True)
        raise


def _walk_the_ui(server: Server, page) -> None:
    expected = server.assets

    # 1. the asset graph: every asset, with all groups expanded
    page.goto(f"{server.url}/asset-groups")
    page.get_by_text("Global asset lineage").first.wait_for()
    page.locator("svg foreignObject").first.wait_for()
    page.wait_for_timeout(1500)
    _expand_all_groups(page)
    names = _graph_node_names(page, len(expected))
    unmatched = {n for n in expected if not any(_node_matches(n, shown) for shown in names)}
    assert not unmatched, f"assets missing from the graph: {unmatched}; graph shows {names}"
    assert len(names) == len(expected), names
    page.screenshot(path=str(ARTIFACTS / "01_asset_graph.png"))

    # 2. materialize task_splits by clicking, and follow the run to success
    before = {r["runId"] for r in server.runs()}
    page.goto(f"{server.url}/assets/task_splits")
    page.get_by_text("by_family", exact=True).first.wait_for()
    page.locator("button", has_text=re.compile(r"^\s*Materialize\s*$")).first.click()
    toast = page.get_by_text(re.compile(r"Launched run"))
    toast.first.wait_for()
    new = _wait_for_new_run(server, before)
    assert new["assetSelection"] == [{"path": ["task_splits"]}], new
    page.goto(f"{server.url}/runs/{new['runId']}")
    run_id_short = new["runId"][:8]
    page.get_by_text(run_id_short).first.wait_for()
    final = _wait_for_run(server, new["runId"])
    assert final == "SUCCESS", f"run {new['runId']} ended {final}; see {ARTIFACTS / 'dagster-dev.log'}"
    page.get_by_text("Success", exact=True).first.wait_for()
    page.screenshot(path=str(ARTIFACTS / "02_run_success.png"))

    # 3. its metadata on the asset page, from this run
    latest = server.gql(
        '{ assetOrError(assetKey: {path: ["task_splits"]}) { ... on Asset { assetMaterializations(limit: 1) { '
        "runId metadataEntries { label } } } } }")["assetOrError"]["assetMaterializations"][0]
    assert latest["runId"] == new["runId"]
    assert {"n_train", "by_family"} <= {e["label"] for e in latest["metadataEntries"]}
    page.goto(f"{server.url}/assets/task_splits")
    for label in ("n_train", "by_family"):
        page.get_by_text(label, exact=True).first.wait_for()
    page.get_by_text("order_status").first.wait_for()  # a row of the by_family table
    page.get_by_text("by_family", exact=True).first.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "03_asset_metadata.png"))

    # 4. capability partition lineage metadata
    assert server.partitions, "the tiny pipeline selects at least one capability"
    partition = server.partitions[0]
    page.goto(f"{server.url}/assets/capability_spec?view=partitions&partition={partition}")
    for label in ("justification", "thresholds", "spec_hash"):
        page.get_by_text(label, exact=True).first.wait_for()
    page.get_by_text(re.compile(r'"example_failed_trajectory_ids"')).first.wait_for()
    page.get_by_text(re.compile(r'"rho"')).first.wait_for()
    page.screenshot(path=str(ARTIFACTS / "04_capability_partition.png"))


def _expand_all_groups(page) -> None:
    """The graph's settings menu (the cog in the zoom column) has "Expand all groups"."""
    cog = page.locator("button", has=page.locator('[role="img"][aria-label="settings"]')).filter(has_not_text="Settings")
    cog.last.click()
    page.get_by_role("menuitem", name=re.compile("Expand all groups")).click()
    page.keyboard.press("Escape")
    page.wait_for_timeout(1500)


def _graph_node_names(page, n_expected: int, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    names: list[str] = []
    while time.monotonic() < deadline:
        names = page.evaluate(
            "() => [...document.querySelectorAll('[class*=\"AssetNode_assetName\"]')].map(e => e.textContent.trim())"
        )
        if len(names) >= n_expected:
            break
        page.wait_for_timeout(500)
    return names


def _wait_for_new_run(server: Server, before: set[str], timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = [r for r in server.runs() if r["runId"] not in before and r["jobName"] == "__ASSET_JOB"]
        if new:
            return new[0]
        time.sleep(1)
    pytest.fail("clicking Materialize launched no run")


def _wait_for_run(server: Server, run_id: str, timeout: float = 150.0) -> str:
    query = "query($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }"
    deadline = time.monotonic() + timeout
    status = "?"
    while time.monotonic() < deadline:
        status = server.gql(query, {"id": run_id})["runOrError"]["status"]
        if status in ("SUCCESS", "FAILURE", "CANCELED"):
            return status
        time.sleep(1)
    return status
