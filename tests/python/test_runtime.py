"""The runtime seen from Python: the log sink under concurrent use, and the
messages that name a dtype or a log file."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import opforge


def _run_python(code, timeout=120, **env):
    full = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                          timeout=timeout)


# ---- log sink -------------------------------------------------------------------------

# Switching the file closed the FILE another thread was writing: a segfault,
# munmap_chunk() abort or hang within a second. In a child process, so that a
# crash fails this test instead of ending the run.
_LOG_SWITCH_STRESS = """
    import sys, threading, time, torch, opforge
    a, b, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    opforge.set_log_level("info")
    stop = threading.Event()
    x = torch.rand(64, 4096)  # large enough that torch's intra-op pool runs the kernel

    def work():
        while not stop.is_set():
            opforge.dispersion_correction(x, 0.5)
            opforge.dispersion_correction(x[:3, :5], 0.5)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for path in (a, b, None):
            opforge.set_log_file(path)
    stop.set()
    for t in threads:
        t.join()
    opforge.set_log_file(a)
    opforge.dispersion_correction(x, 0.5)
    opforge.set_log_file(None)
    print("survived")
"""


def test_log_file_switch_under_concurrent_ops(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    try:
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(_LOG_SWITCH_STRESS), str(a), str(b), "2"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("switching the log file while 4 threads log hung")
    assert r.returncode == 0, f"the process died switching log files (exit status {r.returncode})"
    assert r.stdout.strip() == "survived"
    for path in (a, b):
        lines = path.read_text().splitlines()
        assert lines, f"no log line reached {path.name}"
        torn = [line for line in lines if not (line.startswith("[opforge info] opforge::dispersion_correction ")
                                               and line.endswith("us"))]
        assert not torn, f"{len(torn)} of {len(lines)} lines in {path.name} are torn, e.g. {torn[0]!r}"


def test_set_log_file_unopenable_names_reason_and_caller(tmp_path):
    path = tmp_path / "missing" / "x.log"
    with pytest.raises(RuntimeError) as e:
        opforge.set_log_file(str(path))
    msg = str(e.value)
    assert "set_log_file()" in msg and str(path) in msg and "No such file or directory" in msg, msg
    assert "OPFORGE_LOG_FILE" not in msg, msg
    opforge.dispersion_correction(torch.rand(3), 0.5)  # the sink is still usable


def test_set_log_file_on_a_directory(tmp_path):
    with pytest.raises(RuntimeError, match="set_log_file.*Is a directory"):
        opforge.set_log_file(str(tmp_path))


def test_log_file_env_unopenable_names_variable_and_reason(tmp_path):
    path = tmp_path / "missing" / "x.log"
    r = _run_python("import opforge", OPFORGE_LOG_FILE=str(path))
    assert r.returncode != 0
    assert "OPFORGE_LOG_FILE" in r.stderr and str(path) in r.stderr and "No such file or directory" in r.stderr, \
        r.stderr[-2000:]


# ---- dtype names in messages ------------------------------------------------------------

_NAMED = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.uint16,
          torch.uint32, torch.uint64, torch.complex32, torch.complex64, torch.int16, torch.bool]
if hasattr(torch, "float8_e8m0fnu"):
    _NAMED.append(torch.float8_e8m0fnu)


@pytest.mark.parametrize("dtype", _NAMED, ids=str)
def test_unsupported_dtype_is_named(dtype):
    x = torch.zeros(3, dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(RuntimeError, match=rf"\[opforge::dispersion_correction\] argument 'x' .* got {name}$"):
        opforge.dispersion_correction(x, 1.0)


@pytest.mark.parametrize("dtype", [torch.bits8, torch.bits16, torch.uint4], ids=str)
def test_dtype_without_a_name_gives_its_code(dtype):
    with pytest.raises(RuntimeError, match=r"argument 'x' .* got dtype code \d+$"):
        opforge.dispersion_correction(torch.empty(3, dtype=dtype), 1.0)
