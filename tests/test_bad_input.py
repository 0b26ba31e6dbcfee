"""Hostile input: every case of the bad-input gallery, pinned.

A bad record never stops the rest of its file or of the command; every echoed value is bounded;
conflicts are reported, never resolved silently; names and keys that reach paths are validated.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster import DagsterInstance

from resources.store import TraceStore
from sensors.landing import MAX_ATTEMPTS, load_cursor, process_landing
from tests.openai_server import ScriptedOpenAI
from trace_assets import cli
from trace_assets.identify.capabilities import (
    MAX_DESCRIPTION_CHARS, RESERVED_NAMES, Capability, CapabilityNameError, checked_partition_key,
    safe_capability_name, validate_dictionary,
)
from trace_assets.identify.llm_analyst import DICTIONARY_SCHEMA, LLMAnalyst
from trace_assets.llm_client import ECHOED_REPLY_CHARS, ChatClient, LLMError, complete_json
from trace_assets.route.router import BASE_NAME
from trace_assets.synthesize.spec import envspec_schema
from trace_assets.trajectories import MAX_DEPTH, import_file, quarantine

DEEP = "[" * 5000 + "]" * 5000


def _record(i: int, **extra) -> dict:
    return {
        "task_id": f"retail/order_status/{i:05d}", "env": "retail",
        "messages": [
            {"role": "user", "content": f"Where is order W{i}?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_order_details", "arguments": {"order_id": f"W{i}"}}}]},
            {"role": "tool", "name": "get_order_details", "content": "{}"},
            {"role": "assistant", "content": "It is pending."},
        ],
        "reward": float(i % 2), **extra,
    }


def _line(i: int, **extra) -> str:
    return json.dumps(_record(i, **extra))


def _deep_line(i: int) -> str:
    return _line(i)[:-1] + f', "info": {{"x": {DEEP}}}}}'


@pytest.fixture()
def store(tmp_path, monkeypatch) -> TraceStore:
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    return TraceStore(database=str(tmp_path / "data" / "trace.duckdb"))


def _count(store: TraceStore) -> int:
    return store.query("SELECT count(*) AS n FROM trajectories").item()


# 1. deep nesting ---------------------------------------------------------------------------------

def test_deep_nesting_costs_its_line_only(store, tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join([_line(1), _deep_line(2), _line(3, info={"x": json.dumps(DEEP)})]) + "\n")
    report = import_file(path, store, quarantine_folder=tmp_path / "q")
    assert (report.n_lines, report.n_valid, report.n_inserted) == (3, 2, 2)
    [error] = report.errors
    assert str(error).startswith(f"{path}:2: field '<line>'") and f"deeper than {MAX_DEPTH}" in str(error)
    assert report.quarantined_to and Path(report.quarantined_to).exists()
    # nesting within the limit of the JSON parser but past ours is rejected too, naming the field
    shallow = "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5)
    path2 = tmp_path / "deep2.jsonl"
    path2.write_text(_line(4)[:-1] + f', "info": {{"x": {shallow}}}}}\n')
    [error] = import_file(path2, store, quarantine_folder=tmp_path / "q").errors
    assert ":1: field 'info.x." in str(error) and "deeper than" in str(error)


def test_trace_import_goes_on_after_a_crashing_file(store, tmp_path, capsys):
    deep = tmp_path / "a_deep.jsonl"
    deep.write_text(_deep_line(1) + "\n")
    good = tmp_path / "b_good.jsonl"
    good.write_text(_line(2) + "\n" + _line(3) + "\n")
    assert cli.main(["import", str(deep), str(good)]) == 1
    out = capsys.readouterr().out
    assert "Traceback" not in out and "nested deeper" in out
    assert "b_good.jsonl: 2 lines, 2 valid, 2 new, 0 errors" in out.replace("\n", "")
    assert _count(store) == 2
    assert len(list((tmp_path / "data" / "quarantine").glob("*a_deep.jsonl"))) == 1


def test_trace_import_names_the_file_when_the_importer_itself_fails(store, tmp_path, capsys, monkeypatch):
    """A failure outside any record (here: the store refuses) is one file's error, not a traceback."""
    from resources import store as store_module

    def locked(self, *a, **k):
        raise store_module.StoreBusyError(f"{self.path}: another process still holds DuckDB's write lock")

    first = tmp_path / "one.jsonl"
    first.write_text(_line(1) + "\n")
    second = tmp_path / "two.jsonl"
    second.write_text(_line(2) + "\n")
    monkeypatch.setattr(store_module.TraceStore, "insert_trajectories", locked)
    assert cli.main(["import", str(first), str(second)]) == 1
    out = capsys.readouterr().out.replace("\n", "")
    assert "Traceback" not in out
    assert "one.jsonl: not imported: StoreBusyError" in out and "two.jsonl: not imported" in out
    assert "trace.duckdb" in out


def test_sensor_quarantines_a_deep_file_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "deep.jsonl").write_text(_line(1) + "\n" + _deep_line(2) + "\n")
    store = TraceStore(database=str(tmp_path / "data" / "t.duckdb"))
    logged = []

    class Log:
        def __getattr__(self, level):
            return lambda msg: logged.append((level, msg))

    results, cursor = process_landing(landing, store, load_cursor(None), Log())
    assert [r["status"] for r in results] == ["quarantined"] and results[0]["n_inserted"] == 1
    assert cursor["attempts"] == {} and MAX_ATTEMPTS > 1  # no retries: it was not an importer crash
    assert not any(level == "error" for level, _ in logged)


def test_complete_json_turns_recursion_into_a_retry_and_bounds_the_echo():
    huge_deep = "{\"a\": " + "[" * 100_000 + "]" * 100_000 + "}"
    with ScriptedOpenAI([huge_deep, '{"ok": true}']) as server:
        got = complete_json(ChatClient(server.base_url, "m"), [{"role": "user", "content": "go"}], lambda o: o["ok"])
        assert got is True
        retry = server.requests[1]["messages"]
        assert "nested too deeply" in retry[-1]["content"]
        assert len(retry[-2]["content"]) < ECHOED_REPLY_CHARS + 100 < len(huge_deep)
        assert f"{len(huge_deep):,} characters" in retry[-2]["content"]


def test_llm_analyst_records_deep_answers_as_label_errors_not_crashes():
    caps = [Capability("confirm_before_writing", "Ask before writing.")]
    deep = '{"labels": ' + "[" * 5000 + "]" * 5000 + "}"
    traj = {"trajectory_id": "t1", "info": {}, "messages": [{"role": "user", "content": "hi"}]}
    with ScriptedOpenAI([deep] * 3) as server:
        analyst = LLMAnalyst(ChatClient(server.base_url, "m"), max_retries=2)
        with pytest.raises(LLMError, match="nested too deeply"):
            analyst.label(traj, caps, run=0)
    deep_dict = '{"capabilities": ' + "[" * 5000 + "]" * 5000 + "}"
    with ScriptedOpenAI([deep_dict] * 3) as server:
        with pytest.raises(LLMError, match="nested too deeply"):
            LLMAnalyst(ChatClient(server.base_url, "m"), max_retries=2).induce([traj], [traj])


def test_llm_synthesizer_fails_cleanly_on_deep_answers():
    from trace_assets.envs import get_environment
    from trace_assets.synthesize.llm_synth import llm_spec

    deep = "{\"tasks\": " + "[" * 5000 + "]" * 5000 + "}"
    cap = {"name": "confirm_before_writing", "description": "Ask before writing.", "failure_modes": []}
    with ScriptedOpenAI([deep] * 3) as server:
        with pytest.raises(LLMError, match="nested too deeply"):
            llm_spec(cap, get_environment("retail"), ChatClient(server.base_url, "m"), max_retries=2)


# 2. NaN ------------------------------------------------------------------------------------------

def test_nan_reward_is_rejected_in_jsonl_and_parquet(store, tmp_path):
    path = tmp_path / "nan.jsonl"
    path.write_text("\n".join([_line(1), _line(2).replace('"reward": 0.0', '"reward": NaN'),
                               _line(3, info={"score": 1}).replace('"score": 1', '"score": NaN')]) + "\n")
    report = import_file(path, store, quarantine_folder=tmp_path / "q")
    assert report.n_inserted == 1
    messages = sorted(str(e) for e in report.errors)
    assert messages[0].startswith(f"{path}:2: field 'reward': nan is not a finite number")
    assert messages[1].startswith(f"{path}:3: field 'info.score': nan is not a finite number")
    parquet = tmp_path / "nan.parquet"
    pq.write_table(pa.Table.from_pylist([{**_record(4), "messages": json.dumps(_record(4)["messages"]), "reward": math.nan}]), parquet)
    [error] = import_file(parquet, store, quarantine_folder=tmp_path / "q").errors
    assert str(error).startswith(f"{parquet}:1: field 'reward': nan is not a finite number")
    assert _count(store) == 1


# 3. bytes and encodings --------------------------------------------------------------------------

def test_a_bad_byte_costs_its_line_only(store, tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(_line(1).encode() + b"\n" + _line(2).encode().replace(b"Where", b"Wh\xffere") + b"\n" + _line(3).encode() + b"\n")
    report = import_file(path, store, quarantine_folder=tmp_path / "q")
    assert (report.n_lines, report.n_valid, report.n_inserted) == (3, 2, 2)
    [error] = report.errors
    assert str(error).startswith(f"{path}:2: field '<line>': not UTF-8 text") and "0xff" in str(error)


def test_utf16_is_named_and_a_utf8_bom_is_skipped(store, tmp_path):
    utf16 = tmp_path / "u16.jsonl"
    utf16.write_bytes((_line(1) + "\n").encode("utf-16"))  # Python writes a BOM
    [error] = import_file(utf16, store, quarantine_folder=tmp_path / "q").errors
    assert "UTF-16 LE" in str(error) and "byte-order mark" in str(error) and ":1:" in str(error)
    no_bom = tmp_path / "u16be.jsonl"
    no_bom.write_bytes((_line(1) + "\n").encode("utf-16-be"))
    [error] = import_file(no_bom, store, quarantine_folder=tmp_path / "q").errors
    assert "UTF-16" in str(error) and ":1:" in str(error)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (_line(1) + "\n" + _line(2) + "\n").encode())
    report = import_file(bom, store)
    assert report.ok and report.n_inserted == 2


# 4. bounded echo ---------------------------------------------------------------------------------

def test_huge_values_are_echoed_bounded(store, tmp_path, capsys):
    big = "x" * 2_000_000
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join([_line(1, env=big), _line(2, **{big: 1}), _line(3, policy=None, split=big)]) + "\n")
    report = import_file(path, store, quarantine_folder=tmp_path / "q")
    assert len(report.errors) == 3
    for error in report.errors:
        assert len(str(error)) < 700 and "characters)" in str(error), str(error)
    # the reason survives the cut: the value is clipped, not the keyword it failed
    assert "fails 'pattern'" in str(report.errors[0]) and "fails 'enum'" in str(report.errors[2])
    reason = next((tmp_path / "q").glob("*.reason.json"))
    assert reason.stat().st_size < 5_000
    assert cli.main(["import", str(path)]) == 1
    assert len(capsys.readouterr().out) < 10_000


def test_sensor_log_lines_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "big.jsonl").write_text(_line(1, env="y" * 2_000_000) + "\n" + _line(2) + "\n")
    store = TraceStore(database=str(tmp_path / "data" / "t.duckdb"))
    logged = []

    class Log:
        def __getattr__(self, level):
            return lambda msg: logged.append(msg)

    results, _ = process_landing(landing, store, load_cursor(None), Log())
    assert results[0]["status"] == "quarantined" and logged
    assert max(len(m) for m in logged) < 5_000
    reason = next((tmp_path / "data" / "quarantine").glob("*.reason.json"))
    assert reason.stat().st_size < 5_000


# 5. duplicates -----------------------------------------------------------------------------------

def test_conflicting_duplicates_are_warned_with_both_hashes(store, tmp_path):
    path = tmp_path / "dups.jsonl"
    path.write_text("\n".join([
        _line(1, trajectory_id="x1"), _line(1, trajectory_id="x1"),  # an exact repeat: fine
        _line(2, trajectory_id="x1", reward=0.5),  # same id, other content
    ]) + "\n")
    report = import_file(path, store)
    assert report.ok and report.n_inserted == 1
    [warning] = report.warnings
    text = str(warning)
    assert text.startswith(f"{path}:3: field 'trajectory_id'") and "repeats line 1" in text
    hashes = [w for w in text.replace(")", " ").replace(";", " ").split() if len(w) == 16 and all(c in "0123456789abcdef" for c in w)]
    assert len(set(hashes)) == 2
    # against the store: kept as stored, reported, not overwritten
    other = tmp_path / "other.jsonl"
    other.write_text(_line(1, trajectory_id="x1", reward=0.25) + "\n" + _line(5) + "\n")
    again = import_file(other, store)
    assert again.n_inserted == 1 and "already stored with different content" in str(again.warnings[0])
    assert ":1: field 'trajectory_id'" in str(again.warnings[0])
    assert store.trajectories_by_id(["x1"])[0]["reward"] == 1.0  # the first stored one, _record(1)
    # re-importing the first file again is silent: identical content
    assert not [w for w in import_file(tmp_path / "dups.jsonl", store).warnings if "already stored" in str(w)]


def test_contradictory_analyst_labels_are_rejected_not_last_wins():
    caps = [Capability("confirm_before_writing", "Ask before writing.")]
    traj = {"trajectory_id": "t1", "info": {}, "messages": [{"role": "user", "content": "hi"}]}

    def labels(*pairs):
        return json.dumps({"labels": [{"capability": c, "label": lab, "rationale": "r"} for c, lab in pairs]})

    contradictory = labels(("confirm_before_writing", "PRESENT"), ("confirm_before_writing", "LACKING"))
    with ScriptedOpenAI([contradictory, labels(("confirm_before_writing", "LACKING"), ("confirm_before_writing", "lacking"))]) as server:
        got = LLMAnalyst(ChatClient(server.base_url, "m"), max_retries=1).label(traj, caps, run=0)
        assert [l.label for l in got] == ["LACKING"]  # a consistent repeat is fine
        assert "contradictory labels for confirm_before_writing: PRESENT and LACKING" in server.requests[1]["messages"][-1]["content"]
    with ScriptedOpenAI([contradictory] * 2) as server:
        with pytest.raises(LLMError, match="contradictory"):
            LLMAnalyst(ChatClient(server.base_url, "m"), max_retries=1).label(traj, caps, run=0)


# 6. nested Parquet -------------------------------------------------------------------------------

def test_natively_nested_parquet_is_accepted(store, tmp_path):
    rows = [_record(i) for i in range(3)]
    rows[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"order_id": "W0"})
    for r in rows:  # struct fields must have one type: arguments as JSON strings, like most loggers
        for m in r["messages"]:
            for c in m.get("tool_calls") or []:
                if not isinstance(c["function"]["arguments"], str):
                    c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
    # and natively nested arguments: one struct over every call's keys
    native = [_record(10), _record(11)]
    native[1]["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"user_id": "u11"}
    pq.write_table(pa.Table.from_pylist(native), tmp_path / "native_args.parquet")
    report = import_file(tmp_path / "native_args.parquet", store)
    assert report.ok and report.n_inserted == 2, [str(e) for e in report.errors]
    args = {t["task_id"][-2:]: t["messages"][1]["tool_calls"][0]["function"]["arguments"] for t in store.trajectories()}
    assert args == {"10": {"order_id": "W10"}, "11": {"user_id": "u11"}}
    table = pa.Table.from_pylist(rows)
    assert pa.types.is_list(table.schema.field("messages").type)
    path = tmp_path / "nested.parquet"
    pq.write_table(table, path)
    report = import_file(path, store)
    assert report.ok and report.n_inserted == 3, [str(e) for e in report.errors]
    stored = [t for t in store.trajectories() if t["source"] == "nested.parquet"]
    first = next(t for t in stored if t["task_id"].endswith("00000"))
    assert first["messages"][0] == {"role": "user", "content": "Where is order W0?"}
    assert first["messages"][1]["content"] is None
    assert first["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"order_id": "W0"}


# 7. reserved names -------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", ["base", "__base__", "Base", "con", "NUL", "aux", "prn", "com1", "lpt9", "Com1"])
def test_reserved_names_are_rejected(raw):
    with pytest.raises(CapabilityNameError, match="reserved"):
        safe_capability_name(raw)


def test_reserved_names_include_the_routers_base_and_near_misses_pass():
    assert BASE_NAME in RESERVED_NAMES
    assert safe_capability_name("base_rate_check") == "base_rate_check"
    assert safe_capability_name("console_use") == "console_use"


# 8. partition keys -------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["../../x", "a\nb", "", "x" * 300, "Confirm", "con", "base", "a b", ".hidden"])
def test_bad_partition_keys_are_refused(key):
    with pytest.raises(CapabilityNameError):
        checked_partition_key(key)


def test_good_partition_key_passes():
    assert checked_partition_key("confirm_before_writing") == "confirm_before_writing"


@pytest.mark.parametrize("asset_name", ["synthetic_env", "lora_adapter"])
def test_assets_refuse_a_hand_added_key_before_touching_the_filesystem(tmp_path, monkeypatch, asset_name):
    """A key added in the UI or through the API reaches the asset: it fails before any path is built."""
    from dagster import build_asset_context

    from trace_assets.definitions import defs

    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    asset_def = defs.resolve_assets_def(asset_name)
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("capability", ["../../escape"])
        context = build_asset_context(partition_key="../../escape", instance=instance)
        inputs = {"synthetic_env": {"calibration": {"passed": True}}, "base_agent": {}} if asset_name == "lora_adapter" \
            else {"capability_spec": {}, "base_agent": {}}
        fn = asset_def.op.compute_fn.decorated_fn
        resources = {k: None for k in list(inspect.signature(fn).parameters)[1:] if k not in inputs}
        with pytest.raises(CapabilityNameError, match="partition key"):
            result = fn(context, **resources, **inputs)
            if inspect.isgenerator(result):  # synthetic_env yields its output and check results
                next(result)
    assert not (tmp_path / "escape").exists() and not (tmp_path / "data" / "envs").exists()
    assert not (tmp_path / "data" / "adapters").exists()


# 9. description limits ---------------------------------------------------------------------------

def test_one_description_limit_for_dictionary_and_envspec():
    cap_schema = envspec_schema()["properties"]["capability"]["properties"]
    assert MAX_DESCRIPTION_CHARS == cap_schema["description"]["maxLength"]
    item = DICTIONARY_SCHEMA["properties"]["capabilities"]["items"]["properties"]
    assert item["description"]["maxLength"] == cap_schema["description"]["maxLength"]
    assert item["failure_modes"]["items"]["maxLength"] == cap_schema["failure_modes"]["items"]["maxLength"]
    with pytest.raises(CapabilityNameError, match="2,500 characters"):
        validate_dictionary([{"name": "long_one", "description": "d" * 2500}])
    with pytest.raises(CapabilityNameError, match="failure mode 0"):
        validate_dictionary([{"name": "long_one", "description": "ok", "failure_modes": ["f" * 600]}])
    assert validate_dictionary([{"name": "fits", "description": "d" * MAX_DESCRIPTION_CHARS}])


def test_llm_analyst_retries_an_over_long_description():
    too_long = json.dumps({"capabilities": [{"name": "long_one", "description": "d" * 2500}]})
    fits = json.dumps({"capabilities": [{"name": "long_one", "description": "d" * 100}]})
    traj = {"trajectory_id": "t1", "info": {}, "messages": [{"role": "user", "content": "hi"}]}
    with ScriptedOpenAI([too_long, fits]) as server:
        [cap] = LLMAnalyst(ChatClient(server.base_url, "m")).induce([traj], [traj])
        assert len(cap.description) == 100
        assert "fails 'maxLength' (2000)" in server.requests[1]["messages"][-1]["content"]


# 10. quarantine by content -----------------------------------------------------------------------

def test_requarantining_the_same_file_stores_it_once(store, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(_line(1) + "\n{oops\n")
    folder = tmp_path / "q"
    for _ in range(3):
        import_file(path, store, quarantine_folder=folder)
    copies = [p for p in folder.iterdir() if not p.name.endswith(".reason.json")]
    assert len(copies) == 1 and copies[0].read_bytes() == path.read_bytes()
    reason = json.loads(next(folder.glob("*.reason.json")).read_text())
    assert reason["times"] == 3 and reason["first_quarantined_at"] <= reason["quarantined_at"]
    # a moved copy of the same bytes (the landing folder) is not stored twice either
    landed = tmp_path / "landed.jsonl"
    landed.write_bytes(path.read_bytes())
    quarantine(landed, [], move=True, folder=folder)
    quarantine(path, [], move=False, folder=folder)
    assert not landed.exists() and path.exists()
    assert len([p for p in folder.iterdir() if not p.name.endswith(".reason.json")]) == 1  # same bytes, one copy
