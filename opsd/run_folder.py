"""The run folder (OPSD_OUTPUT): what may be written there, by whom, and what a
re-run into it does.

Standard library only, so that every check here runs before torch or a model
loads. Used by opsd_train.py (and, through `opsd_train.py --check_only`, by
train_capped.sh before it launches accelerate).

- `check_writable`: the folder is a folder (or can be created) and is writable.
- `run_config.json`: the resolved configuration of the run (`write_config`);
  a re-run compares its own with it (`config_conflicts`) and refuses to mix two
  configurations in one folder.
- `.lock`: the PID of the process training into the folder (`RunLock`); a second
  run refuses, a lock left by a dead process is taken over.
- `.staging/`: where checkpoints are written before their atomic rename; a
  leftover from a killed save is removed (`remove_staging`).
- `checkpoint_problem`: why a checkpoint's files cannot be read (resume skips it for the
  newest readable one).
- `metrics.jsonl`: cut back to the resumed step (`truncate_metrics`), so no step
  is recorded twice.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import zipfile

CONFIG_FILE = "run_config.json"
LOCK_FILE = ".lock"
STAGING_DIR = ".staging"  # checkpoints are written here, then renamed into place
# Fault injection for the tests: seconds to sleep inside each checkpoint save, after the
# staged files are written and before the rename, so a test can kill -9 the run there.
SAVE_PAUSE_VARIABLE = "OPSD_TEST_PAUSE_IN_SAVE"
METRICS_FILE = "metrics.jsonl"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")

# Recorded but not compared on resume: where the folder is, how far the run goes
# (a longer max_steps extends a run), how the fixed global batch is split (and grouped
# for the token mean), and where the logs also go (a tracker changes no number of the run).
NOT_COMPARED = (
    "output_dir", "max_steps", "num_processes", "per_device_train_batch_size", "gradient_accumulation_steps",
    "token_mean_rows", "report_to",
)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, folder not writable); earlier ones are intact."""


class RunFolderError(RuntimeError):
    """A run folder that cannot be used; the message is one line."""


def check_writable(path: str) -> None:
    """The run folder exists as a writable folder, or can be created as one."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise RunFolderError(f"output folder {path} is a file, not a folder; choose another OPSD_OUTPUT")
        if not os.access(path, os.W_OK | os.X_OK):
            raise RunFolderError(f"output folder {path} is not writable")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise RunFolderError(f"output folder {path} cannot be created: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RunFolderError(f"output folder {path} cannot be created: {parent} is not writable")


def checkpoints(path: str) -> list[tuple[int, str]]:
    """(step, absolute folder) of every complete `checkpoint-N` in the run folder, by step."""
    if not os.path.isdir(path):
        return []
    found = []
    for name in os.listdir(path):
        match = _CHECKPOINT.match(name)
        full = os.path.join(os.path.abspath(path), name)
        if match and os.path.isfile(os.path.join(full, "trainer_state.json")):
            found.append((int(match.group(1)), full))
    return sorted(found)


def last_checkpoint(path: str) -> tuple[int, str] | None:
    found = checkpoints(path)
    return found[-1] if found else None


def checkpoint_problem(folder: str) -> str | None:
    """Why a complete `checkpoint-N` cannot be resumed from (None: its files read).

    Cheap structural checks, no torch: trainer_state.json parses; each .safetensors file is
    exactly as long as its header says (a file cut short on a full disk or a failed copy is
    not); each torch.save file (.pt, .pth, .bin) is a whole zip archive, whose directory sits
    at its end."""
    try:
        with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as f:
            if not isinstance(json.load(f), dict):
                return "trainer_state.json does not hold a JSON object"
    except (OSError, ValueError) as e:
        return f"trainer_state.json is unreadable ({e})"
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            problem = _safetensors_problem(path)
            if problem:
                return f"{name} {problem}"
        elif name.endswith((".pt", ".pth", ".bin")) and not zipfile.is_zipfile(path):
            return f"{name} is not a whole torch.save archive (truncated?)"
    return None


def _safetensors_problem(path: str) -> str | None:
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else None
            if length is None or 8 + length > size:
                return f"is truncated ({size} bytes, shorter than its header)"
            header = json.loads(f.read(length))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return f"has an unreadable header ({type(e).__name__})"
    expected = 8 + length + end
    if size != expected:
        return f"is truncated ({size} of {expected} bytes)" if size < expected else \
            f"is {size} bytes, its header says {expected}"
    return None


# --------------------------------------------------------------------------
# run_config.json
# --------------------------------------------------------------------------

def read_config(path: str) -> dict | None:
    """The recorded configuration of a run folder, None when there is none."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            recorded = json.load(f)
    except (OSError, ValueError) as e:
        raise RunFolderError(f"{file} is unreadable ({e}); delete it or choose another OPSD_OUTPUT") from None
    if not isinstance(recorded, dict):
        raise RunFolderError(f"{file} does not hold a JSON object; delete it or choose another OPSD_OUTPUT")
    return recorded


def config_conflicts(recorded: dict, current: dict) -> list[str]:
    """Keys whose values differ between two configurations (NOT_COMPARED aside)."""
    keys = (set(recorded) | set(current)) - set(NOT_COMPARED)
    return sorted(k for k in keys if recorded.get(k) != current.get(k))


def write_config(folder: str, config: dict) -> None:
    write_json_atomic(os.path.join(folder, CONFIG_FILE), config)


def write_json_atomic(path: str, payload) -> None:
    """`payload` as indented JSON, written atomically (`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(payload, indent=1, sort_keys=False) + "\n")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write to a temporary file in the same folder, then rename over `path`: a reader
    (or a killed writer) never sees half a file."""
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates it private
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------
# metrics.jsonl and the staging folder
# --------------------------------------------------------------------------

def truncate_metrics(folder: str, step: int) -> None:
    """Keep only the records of steps <= `step` (the step a run resumes from).

    Records of later steps were logged after the checkpoint the run resumes from
    and will be logged again; a torn last line (a kill mid-write) is dropped too.
    """
    path = os.path.join(folder, METRICS_FILE)
    if not os.path.isfile(path):
        return
    kept = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def remove_staging(folder: str) -> bool:
    """Remove `.staging/` (a save killed midway leaves it); True if anything was there."""
    path = os.path.join(folder, STAGING_DIR)
    if not os.path.isdir(path):
        return False
    had_content = bool(os.listdir(path))
    shutil.rmtree(path, ignore_errors=True)
    return had_content


# --------------------------------------------------------------------------
# The lock
# --------------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def slurm_job_id(environ=os.environ) -> str | None:
    """This process's SLURM job as squeue names it: an array task's own id (`812_0`, from
    SLURM_ARRAY_JOB_ID and SLURM_ARRAY_TASK_ID), else SLURM_JOB_ID; None outside SLURM. An array's
    first task has SLURM_JOB_ID = the array's id, which `squeue --jobs` answers for every task."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return environ.get("SLURM_JOB_ID") or None


def _slurm_job_running(job: str) -> bool | None:
    """Whether SLURM still holds job `job` (pending, running, requeued); None where `squeue`
    cannot tell (no SLURM here, or it fails)."""
    import subprocess

    try:
        listing = subprocess.run(["squeue", "--noheader", "--format=%i", "--jobs", job],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if listing.returncode != 0:
        return False if "Invalid job id" in listing.stderr else None
    return bool(listing.stdout.strip())


class RunLock:
    """`.lock` in the run folder, holding `PID HOST [SLURM job]` of the training process (an array
    task's own id, `812_0`: `slurm_job_id`).

    Created with O_EXCL, so of two runs started at once exactly one gets it. A lock is
    stale, and taken over, when its process is gone: same host and PID not alive, or, for a
    lock taken inside a SLURM job, that job has left the queue (a cell killed on one node and
    resubmitted to another). A lock of this very SLURM job is not another run's: the job's
    other machines check the folder while its first one trains, and a requeued job resumes
    where it was killed.
    """

    def __init__(self, folder: str):
        self.path = os.path.join(folder, LOCK_FILE)
        self.held = False

    def acquire(self) -> None:
        folder = os.path.dirname(self.path)
        os.makedirs(folder, exist_ok=True)
        # Written whole under a temporary name, then hard-linked into place: the link
        # fails if the lock exists, and a lock file is never seen half-written.
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".lock.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {socket.gethostname()} {slurm_job_id() or '-'}\n")
        try:
            for _ in range(2):
                try:
                    os.link(tmp, self.path)
                except FileExistsError:
                    # A takeover (check, unlink, link) is one step under the guard: two takers of one
                    # stale lock would otherwise both win, the second unlinking the first's new lock.
                    with self._takeover_guard():
                        self.check()
                        try:  # stale (its process is gone) or unreadable: take it over
                            os.unlink(self.path)
                        except FileNotFoundError:
                            pass
                        try:
                            os.link(tmp, self.path)
                        except FileExistsError:
                            continue
                    self.held = True
                    return
                self.held = True
                return
        finally:
            os.unlink(tmp)
        raise RunFolderError(f"cannot take the lock {self.path}; another run is starting into the same folder")

    @contextlib.contextmanager
    def _takeover_guard(self):
        """An exclusive flock on the run folder itself (no file of its own to leave behind; the kernel
        drops it when its holder ends, however it ends), held while a stale lock is replaced."""
        fd = os.open(os.path.dirname(self.path), os.O_RDONLY)
        try:
            flock(fd, os.path.dirname(self.path))
            yield
        finally:
            os.close(fd)

    def check(self) -> None:
        """Raise RunFolderError when another live process holds the lock (without taking it)."""
        owner = self._owner()
        if owner is None or owner[0] == os.getpid() and owner[1] == socket.gethostname():
            return
        pid, host, job = owner
        if job != "-" and job == slurm_job_id():
            return  # this SLURM job's own lock
        if host == socket.gethostname():
            live = _pid_alive(pid)
        else:  # another host's process: only SLURM can say it is gone
            live = job == "-" or _slurm_job_running(job) is not False
        if live:
            folder = os.path.dirname(self.path)
            raise RunFolderError(
                f"{folder} is in use by another run (PID {pid} on {host}, lock file {self.path}); "
                "wait for it to end or choose another OPSD_OUTPUT"
            )

    def _owner(self) -> tuple[int, str, str] | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                pid, host, *job = f.read().split()
            return int(pid), host, (job or ["-"])[0]
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self.held:
            try:
                os.unlink(self.path)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
            self.held = False

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def flock(fd, path: str, wait: bool = True) -> None:
    """An exclusive fcntl.flock on `fd` (the file or folder `path`); without `wait`, BlockingIOError
    when another process holds it. A filesystem that refuses file locks (Lustre mounted without
    `-o flock`: ENOSYS; NFS without its lock service: ENOLCK) is a RunFolderError of one line,
    naming the filesystem and what to do."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        raise
    except OSError as exc:
        raise RunFolderError(
            f"cannot lock {path}: {exc.strerror or exc} on its filesystem ({filesystem_of(path)}); put the folder "
            "on a filesystem with working file locks (a local disk, Lustre mounted with -o flock, NFS with its "
            "lock service)") from None


def filesystem_of(path: str, mounts: str = "/proc/mounts") -> str:
    """'lustre at /scratch': the type and mount point of the filesystem holding `path` (the
    longest mount point above it in `mounts`), or 'type unknown'."""
    path = os.path.realpath(path)
    best = None
    try:
        with open(mounts, encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])  # \040: a space
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and (best is None or len(point) >= len(best[0])):
                    best = (point, fields[2])
    except OSError:
        pass
    return f"{best[1]} at {best[0]}" if best else "type unknown"


def remove_if_empty(path: str) -> None:
    """Remove the folder `path` if it is empty (the staging folder after a save)."""
    try:
        os.rmdir(path)
    except OSError:
        pass  # absent, or still holds another rank's or another save's files


def pause_in_save(name: str) -> None:
    """The tests' fault injection (SAVE_PAUSE_VARIABLE): a pause inside a checkpoint save."""
    seconds = float(os.environ.get(SAVE_PAUSE_VARIABLE) or 0)
    if seconds > 0:
        print(f"[OPSD test] pausing {seconds:g} s inside the save of {name}", flush=True)
        sys.stdout.flush()
        time.sleep(seconds)
