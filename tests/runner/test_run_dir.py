"""The run directory: torn-line repair, resume state, locking, layouts, record formats."""
from __future__ import annotations

import json
import os

import pytest

from batchinfer.runner.io.input_records import InputError
from batchinfer.runner.io.inputs import Shard
from batchinfer.runner.io.records import (RequestPayload, error_record, input_error_record,
                                       output_record, record_id)
from batchinfer.engine.request import FinishReason, RequestOutput
from batchinfer.runner.run_dir import (ERRORS, OUTPUTS, RunDir, RunDirError, in_use,
                                       repair_torn_tail)


def _out(rid="r1", text="hello", logprobs=None, n_prompt=3, n_out=2):
    return RequestOutput(request_id=rid, prompt_token_ids=list(range(n_prompt)),
                         output_token_ids=list(range(n_out)), text=text,
                         finish_reason=FinishReason.STOP, logprobs=logprobs,
                         arrival_time=1.0, first_token_time=1.5, finish_time=2.0)


# --- torn lines -------------------------------------------------------------------------------------
@pytest.mark.parametrize("content,expected", [
    (b"", b""),
    (b'{"a":1}\n', b'{"a":1}\n'),
    (b'{"a":1}\n{"b":', b'{"a":1}\n'),
    (b'{"b":', b""),
    (b'{"a":1}\n' * 10000 + b'{"b":2', b'{"a":1}\n' * 10000),
])
def test_repair_torn_tail(tmp_path, content, expected):
    path = tmp_path / "f.jsonl"
    path.write_bytes(content)
    dropped = repair_torn_tail(path)
    assert path.read_bytes() == expected
    assert dropped == len(content) - len(expected)


def test_open_repairs_and_loads_prior_state(tmp_path):
    (tmp_path / OUTPUTS).write_text(
        json.dumps({"id": "a", "text": "x", "prompt_tokens": 4, "completion_tokens": 2}) + "\n"
        + json.dumps({"id": "b", "text": "y", "prompt_tokens": 1, "completion_tokens": 1}) + "\n"
        + '{"id": "c", "te')
    (tmp_path / ERRORS).write_text(json.dumps({"id": None, "line": 7, "code": "invalid_json",
                                               "message": "m"}) + "\n")
    run_dir, prior = RunDir.open(tmp_path)
    run_dir.close()
    assert prior.num_outputs == 2 and prior.num_errors == 1
    assert "a" in prior.done_ids and "b" in prior.done_ids and "c" not in prior.done_ids
    assert "7" in prior.done_lines
    assert prior.prompt_tokens == 5 and prior.completion_tokens == 3
    assert prior.error_codes == {"invalid_json": 1}
    assert prior.torn_bytes > 0
    assert (tmp_path / OUTPUTS).read_text().endswith("}\n")


def test_openai_envelope_ids_are_custom_ids(tmp_path):
    payload = RequestPayload(line=1, custom_id="cust-1", openai_url="/v1/chat/completions")
    run_dir, _ = RunDir.open(tmp_path)
    run_dir.write_output(output_record(_out("cust-1"), payload, "m"))
    run_dir.close()
    _, prior = RunDir.open(tmp_path, read_only=True)
    assert "cust-1" in prior.done_ids and prior.completion_tokens == 2


def test_results_are_flushed_line_by_line(tmp_path):
    run_dir, _ = RunDir.open(tmp_path)
    run_dir.write_output({"id": "a", "text": "é ☃"})
    # visible to another reader before close: flushed, not buffered
    assert (tmp_path / OUTPUTS).read_text(encoding="utf-8") == '{"id":"a","text":"é ☃"}\n'
    run_dir.write_error({"id": "bad\ud800", "line": 3})  # a lone surrogate from a JSON escape
    run_dir.close()
    assert json.loads((tmp_path / ERRORS).read_text())["id"] == "bad\ud800"


def test_non_finite_metadata_is_written_as_null(tmp_path):
    """A parquet float column's NaN (or a JSONL line's NaN / Infinity, which Python's json reads)
    went out as NaN / Infinity: not JSON, so jq, JSON.parse and Go refused the line."""
    import numpy as np

    run_dir, _ = RunDir.open(tmp_path)
    run_dir.write_output({"id": "a", "text": "x", "metadata": {
        "v": float("nan"), "w": [float("inf"), 1.5], "n": np.float32("-inf"), "k": np.int64(3)}})
    run_dir.close()
    line = (tmp_path / OUTPUTS).read_text(encoding="utf-8")
    record = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} written"))
    assert record["metadata"] == {"v": None, "w": [None, 1.5], "n": None, "k": 3}


def test_bytes_metadata_is_written_as_base64(tmp_path):
    """A parquet / arrow binary column's value went out as Python's "b'\\x00...'" repr."""
    import base64

    run_dir, _ = RunDir.open(tmp_path)
    run_dir.write_output({"id": "a", "text": "x", "metadata": {
        "blob": b"\x00\xffPNG", "parts": [bytearray(b"ab")]}})
    run_dir.close()
    record = json.loads((tmp_path / OUTPUTS).read_text(encoding="utf-8"))
    assert base64.b64decode(record["metadata"]["blob"]) == b"\x00\xffPNG"
    assert record["metadata"]["parts"] == ["YWI="]


def test_lock_keeps_a_second_run_out(tmp_path):
    first, _ = RunDir.open(tmp_path)
    assert in_use(tmp_path)
    with pytest.raises(RunDirError, match="in use by another batchinfer run"):
        RunDir.open(tmp_path)
    first.close()
    assert not in_use(tmp_path)
    second, _ = RunDir.open(tmp_path)
    second.close()


def test_no_resume_refuses_existing_results(tmp_path):
    (tmp_path / OUTPUTS).write_text('{"id": "a"}\n')
    with pytest.raises(RunDirError, match="--no-resume"):
        RunDir.open(tmp_path, resume=False)
    fresh, _ = RunDir.open(tmp_path / "new", resume=False)
    fresh.close()


def test_layouts_do_not_mix(tmp_path):
    part, _ = RunDir.open(tmp_path / "run", Shard(1, 4))
    part.close()
    assert (tmp_path / "run" / "part-00001-of-00004").is_dir()
    with pytest.raises(RunDirError, match="srun -n 4"):
        RunDir.open(tmp_path / "run")
    with pytest.raises(RunDirError, match="srun -n 4"):
        RunDir.open(tmp_path / "run", Shard(0, 2))
    single, _ = RunDir.open(tmp_path / "single")
    single.write_output({"id": "x"})
    single.close()
    with pytest.raises(RunDirError, match="single-process run"):
        RunDir.open(tmp_path / "single", Shard(0, 2))


def test_a_part_cannot_start_beside_a_single_process_run_that_is_starting(tmp_path, monkeypatch):
    """A plain run still setting up (its lock held, nothing written yet) keeps a --shard run out
    of its directory, and the refused part leaves no directory behind; the layout is checked
    again once the lock is held, so a part made while a plain run opened is seen then."""
    import batchinfer.runner.run_dir as run_dir

    plain, _ = RunDir.open(tmp_path / "run")
    with pytest.raises(RunDirError, match="single-process run .*starting"):
        RunDir.open(tmp_path / "run", Shard(1, 2))
    assert not (tmp_path / "run" / "part-00001-of-00002").exists()
    plain.close()
    # the other order, racing: the part appears between the plain run's first check and its lock
    real_lock = run_dir._lock

    def lock_after_a_part_appeared(path):
        (path / "part-00000-of-00002").mkdir(exist_ok=True)
        return real_lock(path)

    monkeypatch.setattr(run_dir, "_lock", lock_after_a_part_appeared)
    with pytest.raises(RunDirError, match="split into 2 parts"):
        RunDir.open(tmp_path / "raced")



def test_parts_starting_together_do_not_refuse_each_other(tmp_path):
    """Each part probes the run root's lock (a single-process run starting there?) with a shared
    lock: a probe another part holds at that moment is no run."""
    import fcntl

    root = tmp_path / "run"
    plain, _ = RunDir.open(root)          # a start that stopped before any result: its lock file
    plain.close()
    fd = os.open(root / ".lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)        # another part's probe, mid-way
        part, _ = RunDir.open(root, Shard(0, 2))
        part.close()
    finally:
        os.close(fd)


def test_atomic_report_files(tmp_path):
    run_dir, _ = RunDir.open(tmp_path)
    run_dir.write_report({"status": "running"}, "# r\n", {"a.png": b"\x89PNG"})
    run_dir.write_report({"status": "completed"}, "# r2\n")
    run_dir.close()
    assert json.loads((tmp_path / "report.json").read_text())["status"] == "completed"
    assert (tmp_path / "plots" / "a.png").read_bytes() == b"\x89PNG"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".report")]
    assert oct((tmp_path / "report.json").stat().st_mode & 0o777) != oct(0o600)


# --- records ----------------------------------------------------------------------------------------
def test_flat_output_record():
    payload = RequestPayload(line=4, metadata={"k": [1]})
    record = output_record(_out(logprobs=[{"token_id": 1, "token": "a", "logprob": -0.1,
                                           "top_logprobs": []}]), payload, "model")
    assert record == {"id": "r1", "text": "hello", "finish_reason": "stop", "prompt_tokens": 3,
                      "completion_tokens": 2, "logprobs": record["logprobs"], "metadata": {"k": [1]}}
    assert record_id(record) == "r1"


@pytest.mark.parametrize("url,obj", [("/v1/chat/completions", "chat.completion"),
                                     ("/v1/completions", "text_completion")])
def test_openai_output_envelope(url, obj):
    payload = RequestPayload(line=1, custom_id="c-9", openai_url=url, openai_model="gpt-x")
    lp = [{"token_id": 5, "token": "hi", "logprob": -0.5,
           "top_logprobs": [{"token_id": 5, "token": "hi", "logprob": -0.5}]}]
    record = output_record(_out("c-9", logprobs=lp), payload, "model")
    assert record["custom_id"] == "c-9" and record["error"] is None
    assert record["id"].startswith("batch_req_")
    response = record["response"]
    assert response["status_code"] == 200 and response["request_id"].startswith("req_")
    body = response["body"]
    assert body["object"] == obj and body["model"] == "gpt-x"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    if obj == "chat.completion":
        assert choice["message"] == {"role": "assistant", "content": "hello"}
        assert choice["logprobs"]["content"][0]["logprob"] == -0.5
    else:
        assert choice["text"] == "hello" and choice["logprobs"]["token_logprobs"] == [-0.5]
    assert record_id(record) == "c-9"
    # the same custom_id always gets the same envelope ids (a resumed run writes the same)
    again = output_record(_out("c-9"), payload, "model")
    assert again["id"] == record["id"]


def test_completions_logprobs_in_the_legacy_form():
    """/v1/completions' logprobs as OpenAI and vLLM give them: a top_logprobs dict always holds
    the sampled token (logprobs: 0 gave {}; a sampled token outside the top N was missing, so
    top_logprobs[i][tokens[i]] raised), and text_offset is there."""
    payload = RequestPayload(line=1, custom_id="c-1", openai_url="/v1/completions")
    lp = [{"token_id": 5, "token": " hi", "logprob": -0.5, "top_logprobs": []},
          {"token_id": 6, "token": " there", "logprob": -3.0,
           "top_logprobs": [{"token_id": 7, "token": "!", "logprob": -0.1}]}]
    logprobs = output_record(_out("c-1", logprobs=lp), payload, "m")[
        "response"]["body"]["choices"][0]["logprobs"]
    assert logprobs == {"tokens": [" hi", " there"], "token_logprobs": [-0.5, -3.0],
                        "top_logprobs": [{" hi": -0.5}, {" there": -3.0, "!": -0.1}],
                        "text_offset": [0, 3]}


def test_error_records():
    plain = input_error_record(InputError(5, "invalid_json", "bad"), openai_input=False)
    assert plain == {"id": None, "line": 5, "code": "invalid_json", "message": "bad"}
    openai = error_record(6, "unsupported_url", "no", "c1", custom_id="c1", openai=True)
    assert openai["custom_id"] == "c1" and openai["response"] is None
    assert openai["error"] == {"code": "unsupported_url", "message": "no"}
    assert openai["line"] == 6


# --- failed writes ----------------------------------------------------------------------------------
FILL_UNDER_LIMIT = """
import json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # as the job does: EFBIG, not a kill
from batchinfer.runner.run_dir import RunDir, RunDirWriteError
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
run_dir, _ = RunDir.open(sys.argv[1])
written = 0
try:
    for i in range(10_000):
        run_dir.write_output({"id": f"r{i}", "text": "x" * (37 + i % 50)})
        written += 1
except RunDirWriteError as exc:
    print(json.dumps({"written": written, "error": str(exc), "errno": exc.errno}))
try:
    run_dir.write_report({"big": "y" * 2 * limit}, "md")
except RunDirWriteError as exc:
    print(json.dumps({"report_error": str(exc)}))
run_dir.close()
"""


@pytest.mark.parametrize("limit", [3000, 4096, 7777])
def test_a_write_past_the_file_size_limit_is_undone_and_named(tmp_path, limit):
    import errno
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FILL_UNDER_LIMIT, str(tmp_path), str(limit)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = (json.loads(line) for line in out.stdout.splitlines())
    assert first["errno"] == errno.EFBIG
    assert "outputs.jsonl" in first["error"] and "file-size limit" in first["error"]
    data = (tmp_path / OUTPUTS).read_bytes()
    assert data.endswith(b"\n") and len(data) <= limit      # cut back to the last whole line
    ids = [json.loads(line)["id"] for line in data.splitlines()]
    assert ids == [f"r{i}" for i in range(first["written"])]
    assert "report.json" in second["report_error"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report")]


FINAL_REPORT_ON_A_FULL_DISK = """
import errno, json, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
import resource
from batchinfer.runner.run_dir import RunDir, RunDirWriteError
run_dir, _ = RunDir.open(sys.argv[1])
run_dir.write_report({"status": "running", "outputs": 1}, "md")
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))   # room for the report, not the plot
try:
    run_dir.write_report({"status": "failed", "outputs": 2}, "md", {"a.png": b"p" * 20_000})
except RunDirWriteError as exc:
    print(exc.errno == errno.EFBIG)
run_dir.close()
"""


def test_a_final_report_that_fills_the_disk_still_says_how_the_run_ended(tmp_path):
    """The disk fills during the final report: report.json is written before the plots, so it
    says 'failed' with the final counts (it kept the last refresh's 'running' and its counts,
    the plots having failed the write first)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FINAL_REPORT_ON_A_FULL_DISK, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    assert json.loads((tmp_path / "report.json").read_text()) == {"status": "failed",
                                                                  "outputs": 2}
    assert not (tmp_path / "plots" / "a.png").exists()


def test_a_result_file_that_cannot_be_opened_for_writing_is_a_usage_error(tmp_path,
                                                                            monkeypatch):
    """A resume whose outputs.jsonl is read-only (chmod a-w, another user's, immutable) is
    refused naming the file and what to do (exit 2), as a directory that cannot be written is;
    it failed as the run itself (exit 3, 'failed: 0 outputs', 'rerun to resume') with a
    traceback, though rerunning could not help."""
    import errno

    from batchinfer.runner import run_dir as run_dir_module

    first, _ = RunDir.open(tmp_path)
    first.write_output({"id": "r1", "text": "kept"})
    first.close()

    def read_only(path):
        if path.exists():
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return 0

    monkeypatch.setattr(run_dir_module, "repair_torn_tail", read_only)
    with pytest.raises(RunDirError, match=r"the run directory .* cannot be resumed: .*"
                       r"outputs\.jsonl: Operation not permitted; fix its permissions"):
        RunDir.open(tmp_path)
    assert (tmp_path / OUTPUTS).read_text() == '{"id":"r1","text":"kept"}\n'
    assert not in_use(tmp_path)


def test_a_run_directory_that_cannot_be_written_is_a_usage_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(RunDirError, match=r"a-file/run cannot be written.*--output"):
        RunDir.open(blocker / "run")
