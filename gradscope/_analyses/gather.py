"""Recordings of a ``torch.distributed`` job: ``gs.gather`` moves them to one rank over the job's
own process group (each rank's peak under DDP or FSDP is :mod:`gradscope._analyses.predict_job`).

NOTE [ no pickle on the wire ]: ``torch.distributed``'s object collectives (``gather_object``,
``all_gather_object``, ``broadcast_object_list``) pickle each object and *unpickle* what the other
ranks sent, which runs whatever code the bytes name. gradscope never unpickles: each rank turns its
recording into JSON (:meth:`Recording.to_json`), sends the UTF-8 bytes as a ``uint8`` tensor after
a small ``int64`` header (magic, protocol version, kind, byte count), and the destination parses
the JSON with :meth:`Recording.from_dict`, which checks every field (NOTE [ files are data ]).

NOTE [ gathering without hanging ]: a collective waits for every rank; a rank that raised before
calling ``gather`` would leave the others waiting until the process group's own timeout (30
minutes by default), or forever. So ``gather`` uses point-to-point messages instead of a
collective: every other rank sends its header and bytes to ``dst`` (tags of its own, so user
traffic is never matched), and ``dst`` posts one receive per rank and waits for each until one
shared deadline (``timeout``). A rank whose header has not arrived by then, or whose connection
broke (its process exited), is reported as missing. Gloo honours ``Work.wait(timeout)`` for
point-to-point receives (measured: a 3 s timeout returns after 3.0 s; a peer that exited is
reported at once as "Connection reset by peer"). After a timeout the late rank's receive stays
posted, so do not gather again over the same group with that rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
import warnings
from typing import Any

import torch

from gradscope._base.errors import GradscopeError
from gradscope._model.job import Job, RankEntry, RankStatus
from gradscope._model.recording import Recording

__all__ = ["gather"]

_MAGIC = 0x67726164  # "grad"
_PROTOCOL = 1
_TAG = 0x6753  # gather's header tag; the payload uses _TAG + 1
_MAX_PAYLOAD = 1 << 30  # as for files: a recording of a 200,000-node graph is about 60 MB
_KIND_RECORDING, _KIND_NONE, _KIND_UNSENDABLE = 0, 1, 2


def gather(
    recording: Recording | Any,
    dst: int = 0,
    group: Any = None,
    timeout: float | datetime.timedelta | None = None,
    *,
    label: str = "",
) -> Job | None:
    """Collect every rank's recording on rank ``dst``. Every rank of the group calls it after its
    block (also a rank whose block raised: pass its partial recording; ``finally`` is the place).

    Args:
        recording: this rank's :class:`~gradscope.Recording`, or the ``gs.record`` object (its
            ``.recording`` is taken), or None when this rank has nothing to send.
        dst: the global rank that receives the job.
        group: the process group (default: the default group the job initialized).
        timeout: seconds (or a ``timedelta``) that ``dst`` waits for the other ranks; a rank that
            has not sent by then is marked missing instead of waited for. Other ranks wait as long
            for ``dst`` to receive. None: the process group's own timeout.
        label: a name for the job.

    Returns:
        On ``dst``, a :class:`~gradscope.job.Job` with one entry per rank of the group, ordered
        by group rank (``global_rank`` says each one's rank in the default group): complete, failed (its block raised: the partial recording, ``message`` is
        its error), missing (never arrived: ``message`` says why) or unreadable. On other ranks,
        None.

    Raises:
        GradscopeError: no process group is initialized, or ``dst`` is not in the group.

    Example (every rank of a torchrun job)::

        with gs.record() as rec:
            loss = model(batch).mean(); loss.backward()
        job = gs.gather(rec, timeout=60)
        if job is not None:
            print(job.summary()); job.save("step1")
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise GradscopeError(
            "gradscope: gs.gather needs torch.distributed: call it in every rank after "
            "init_process_group (with one process, use the recording itself)."
        )
    rec = _recording_of(recording)
    seconds = _seconds(timeout)
    me = dist.get_rank(group)
    world = dist.get_world_size(group)
    if me < 0:
        raise GradscopeError("gradscope: gs.gather was called on a rank that is not in `group`.")
    try:
        dst_in_group = dist.get_group_rank(group, dst) if group is not None else dst
    except (RuntimeError, ValueError):
        dst_in_group = -1
    if not 0 <= dst_in_group < world:
        raise GradscopeError(f"gradscope: gs.gather(dst={dst}): rank {dst} is not in the group of {world} ranks.")
    device = _comm_device(group)
    kind, payload = _encode(rec)
    if me != dst_in_group:
        _send(kind, payload, dst, group, device, seconds, me)
        return None
    return _receive(rec, me, world, group, device, seconds, label)


def _recording_of(obj: Any) -> Recording | None:
    if obj is None or isinstance(obj, Recording):
        return obj
    inner = getattr(obj, "recording", None)
    if isinstance(inner, Recording) or (inner is None and hasattr(obj, "recording")):
        return inner
    raise GradscopeError(
        f"gradscope: gs.gather takes a Recording (rec.recording after a gs.record block), not a "
        f"{type(obj).__name__}."
    )


def _seconds(timeout: float | datetime.timedelta | None) -> float | None:
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(s, bool) or not isinstance(s, int | float) or not s > 0:
        raise GradscopeError(f"gradscope: gs.gather(timeout={timeout!r}): give seconds > 0, or None.")
    return float(s)


def _comm_device(group: Any) -> torch.device:
    """Where the message tensors live: the GPU for NCCL, the CPU otherwise (gloo, and gloo
    beside NCCL: ``"cpu:gloo,cuda:nccl"`` takes CPU tensors)."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "gloo" not in backend and "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(rec: Recording | None) -> tuple[int, bytes]:
    if rec is None:
        return _KIND_NONE, b"this rank called gs.gather without a recording"
    try:
        return _KIND_RECORDING, rec.to_json().encode("utf-8")
    except (TypeError, ValueError) as e:  # extra data that is not JSON
        return _KIND_UNSENDABLE, f"its recording could not be written as JSON ({e})".encode()


def _wait(work: Any, deadline: float | None) -> None:
    if deadline is None:
        work.wait()
        return
    left = max(deadline - time.monotonic(), 0.001)
    work.wait(datetime.timedelta(seconds=left))


def _send(kind: int, payload: bytes, dst: int, group: Any, device: torch.device, seconds: float | None,
          me: int) -> None:
    import torch.distributed as dist

    header = torch.tensor([_MAGIC, _PROTOCOL, kind, len(payload)], dtype=torch.int64, device=device)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if payload else None
    deadline = None if seconds is None else time.monotonic() + seconds
    try:
        _wait(dist.isend(header, dst, group=group, tag=_TAG), deadline)
        if data is not None:
            _wait(dist.isend(data, dst, group=group, tag=_TAG + 1), deadline)
    except Exception as e:  # dst gone or late: the job goes on without this rank's recording
        warnings.warn(
            f"gradscope: rank {me} could not send its recording to rank {dst} ({_first_line(e)}); "
            f"the job on rank {dst} will show it as missing.",
            RuntimeWarning,
            stacklevel=3,
        )


def _receive(own: Recording | None, me: int, world: int, group: Any, device: torch.device,
             seconds: float | None, label: str) -> Job:
    import torch.distributed as dist

    deadline = None if seconds is None else time.monotonic() + seconds
    headers: dict[int, tuple[Any, torch.Tensor]] = {}
    entries: dict[int, RankEntry] = {me: _entry(me, _KIND_RECORDING if own is not None else _KIND_NONE, own)}
    for r in range(world):
        if r != me:
            h = torch.zeros(4, dtype=torch.int64, device=device)
            src = dist.get_global_rank(group, r) if group is not None else r
            try:
                headers[r] = (dist.irecv(h, src, group=group, tag=_TAG), h)
            except Exception as e:  # gloo refuses at once when the peer's connection is closed
                entries[r] = RankEntry(r, RankStatus.MISSING, None, _why_missing(e, seconds), "gathered")
    payloads: dict[int, tuple[Any, torch.Tensor, int]] = {}
    for r, (work, h) in headers.items():
        try:
            _wait(work, deadline)
        except Exception as e:
            entries[r] = RankEntry(r, RankStatus.MISSING, None, _why_missing(e, seconds), "gathered")
            continue
        magic, proto, kind, n = (int(v) for v in h.cpu().tolist())
        if magic != _MAGIC or proto != _PROTOCOL or kind not in (0, 1, 2) or not 0 <= n <= _MAX_PAYLOAD:
            entries[r] = RankEntry(
                r, RankStatus.UNREADABLE, None,
                f"its message is not a gradscope recording (header {[magic, proto, kind, n]}); "
                "did every rank call gs.gather with the same gradscope version?", "gathered",
            )
            continue
        buf = torch.empty(n, dtype=torch.uint8, device=device)
        src = dist.get_global_rank(group, r) if group is not None else r
        try:
            work = dist.irecv(buf, src, group=group, tag=_TAG + 1) if n else None
        except Exception as e:
            entries[r] = RankEntry(r, RankStatus.MISSING, None,
                                   f"its connection broke after its header ({_first_line(e)})", "gathered")
            continue
        payloads[r] = (work, buf, kind)
    for r, (work, buf, kind) in payloads.items():
        try:
            if work is not None:  # it has arrived: its bytes follow at once, the deadline is not theirs
                _wait(work, None if deadline is None else max(deadline, time.monotonic() + 60.0))
        except Exception as e:
            entries[r] = RankEntry(r, RankStatus.MISSING, None,
                                   f"its recording was cut off in transfer ({_first_line(e)})", "gathered")
            continue
        entries[r] = _decode(r, kind, buf.cpu().numpy().tobytes())
    notes = []
    if group is not None:  # ranks in the job are group ranks; say which global rank each is
        entries = {r: dataclasses.replace(e, global_rank=dist.get_global_rank(group, r))
                   for r, e in entries.items()}
    for entry in entries.values():
        rec = entry.recording
        expected = entry.rank if entry.global_rank is None else entry.global_rank
        if rec is not None and rec.where.rank is not None and rec.where.rank != expected:
            notes.append(f"rank {expected} sent a recording made on rank {rec.where.rank}.")
    return Job(tuple(entries[r] for r in range(world)), label=label, notes=tuple(notes))


def _entry(rank: int, kind: int, rec: Recording | None, message: str = "") -> RankEntry:
    if kind == _KIND_RECORDING and rec is not None:
        status = RankStatus.COMPLETE if rec.complete else RankStatus.FAILED
        return RankEntry(rank, status, rec, rec.error or "", "gathered")
    if kind == _KIND_NONE:
        return RankEntry(rank, RankStatus.MISSING, None, message or "it called gs.gather without a recording",
                         "gathered")
    return RankEntry(rank, RankStatus.UNREADABLE, None, message, "gathered")


def _decode(rank: int, kind: int, raw: bytes) -> RankEntry:
    if kind != _KIND_RECORDING:
        text = raw.decode("utf-8", errors="replace")
        return _entry(rank, kind, None, text)
    try:
        rec = Recording.from_dict(json.loads(raw.decode("utf-8")))
    except GradscopeError as e:
        return _entry(rank, _KIND_UNSENDABLE, None, str(e))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        return _entry(rank, _KIND_UNSENDABLE, None, f"its bytes are not a JSON recording ({_first_line(e)})")
    return _entry(rank, _KIND_RECORDING, rec)


def _why_missing(e: BaseException, seconds: float | None) -> str:
    text = _first_line(e)
    if "timed out" in text.lower() or "timeout" in text.lower():
        wait = f"{seconds:g} s" if seconds is not None else "the process group's timeout"
        return f"it did not call gs.gather within {wait} (it raised before, or hangs)"
    return f"its connection broke before it sent anything (its process probably exited): {text}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    # gloo prefixes its messages with the C++ source location: keep what follows
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0][:300]
