"""The SLURM grid's wait for its cells (opsd.research.slurm_grid._wait) on scripted squeue states
and a fake clock: a requeued job that looks ended for a moment is not resubmitted; one that stays
ended without results is, once its end has been seen for ENDED_CONFIRM_S. (The same paths
against a real cluster: tests/research/test_slurm.py.)"""
import types

from opsd.research import slurm_grid
from opsd.research.executors import JobState


class ScriptedWatch:
    """squeue's answers, one {job: JobState} a poll (the last one repeats); `on_poll(i)` runs before
    the i-th answer (a cell writing its report)."""

    def __init__(self, script, on_poll=lambda i: None):
        self.script, self.on_poll, self.polls = script, on_poll, 0

    def states(self, job_ids):
        if not job_ids:
            return {}
        self.on_poll(self.polls)
        answer = self.script[min(self.polls, len(self.script) - 1)]
        self.polls += 1
        return {job: answer[job] for job in job_ids if job in answer}

    def queued(self, job_ids):
        return {job: s.state for job, s in self.states(job_ids).items() if not s.ended}


class Clock:
    def __init__(self):
        self.now = 0.0

    def sleep(self, seconds):
        self.now += seconds

    def monotonic(self):
        return self.now


def _wait(tmp_path, monkeypatch, watch, jobs, submit=None):
    clock = Clock()
    monkeypatch.setattr(slurm_grid, "time", types.SimpleNamespace(sleep=clock.sleep, monotonic=clock.monotonic))
    folder = tmp_path / "a" / "seed-0"
    folder.mkdir(parents=True)
    cell = types.SimpleNamespace(name="a/seed-0", folder=folder, report=folder / "eval.json")
    said, submitted = [], []

    def submitter(names):
        submitted.append((clock.now, list(names)))
        if submit:
            submit(names)

    args = types.SimpleNamespace(parallel=None, poll=2)
    outcomes = slurm_grid._wait([cell], tmp_path, args, said.append, jobs, {}, [], watch,
                                types.SimpleNamespace(submit=submitter), slurm_grid.Tries(tmp_path))
    return outcomes, said, submitted, cell


def test_a_job_that_looks_ended_for_one_poll_while_it_is_requeued_is_waited_for(tmp_path, monkeypatch):
    running, requeued = JobState("RUNNING", "n1"), JobState("PENDING", "", "BeginTime")
    script = [{"7": running}, {"7": JobState("COMPLETED", "n1")}, {"7": requeued}, {"7": running},
              {"7": JobState("COMPLETED", "n1")}]

    def finish(poll):
        if poll == 4:
            (tmp_path / "a" / "seed-0" / "eval.json").write_text("{}")

    outcomes, said, submitted, _ = _wait(tmp_path, monkeypatch, ScriptedWatch(script, finish), {"a/seed-0": "7"})
    assert outcomes == {"a/seed-0": "done"} and submitted == []
    assert not any("ended without results" in line for line in said), said
    assert not (tmp_path / slurm_grid.TRIES_FILE).exists()


def test_a_job_still_ended_without_results_after_the_confirmation_time_is_resubmitted(tmp_path, monkeypatch):
    jobs = {"a/seed-0": "7"}
    log = tmp_path / "slurm" / "7" / "7_0_log.err"  # where submitit's job writes its errors
    log.parent.mkdir(parents=True)
    log.write_text("srun: error: n1: task 0: Exited with exit code 1\n")
    script = [{"7": JobState("RUNNING", "n1")}, {"7": JobState("FAILED", "n1"), "8": JobState("RUNNING", "n2")}]

    def resubmit(names):
        jobs.update(dict.fromkeys(names, "8"))

    def finish(poll):  # job 8 writes the report once it runs
        if "8" in jobs.values() and poll > 12:
            (tmp_path / "a" / "seed-0" / "eval.json").write_text("{}")
            script.append({"8": JobState("COMPLETED", "n2")})

    outcomes, said, submitted, _ = _wait(tmp_path, monkeypatch, ScriptedWatch(script, finish), jobs, resubmit)
    assert outcomes == {"a/seed-0": "done"}
    first_seen = 2.0  # one poll (2 s) after the run was seen running
    assert len(submitted) == 1 and submitted[0][0] >= first_seen + slurm_grid.ENDED_CONFIRM_S, submitted
    failed = [line for line in said if "ended without results" in line]
    assert len(failed) == 1, said
    assert failed[0].startswith("a/seed-0: job 7 ended without results (FAILED; srun: error: n1: task 0: Exited")
    assert "excluding node n1" in failed[0]
    assert slurm_grid.Tries(tmp_path).count("a/seed-0") == 1
