"""The encoder's work queue. Pure logic (a lock, no I/O), shared by the event loop and the encoder thread.

A ``Job`` is one image (or one video: ``frames`` > 0) to run through the vision tower. Its state only moves forward:
QUEUED -> RUNNING -> ENDED, or QUEUED -> ENDED when cancelled. ``Batcher.take`` hands the encoder
thread the oldest queued jobs, up to ``max_images`` (one image each), and marks them RUNNING in the
same locked step, so ``cancel`` (from the event loop) succeeds exactly for jobs no thread has taken.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from enum import IntEnum

from stages.engine.multimodal import ImageInput


class JobState(IntEnum):
    QUEUED = 0
    RUNNING = 1
    ENDED = 2


@dataclass(eq=False)
class Job:
    key: str  # the image's (or video's) cache key
    image: ImageInput
    state: JobState = JobState.QUEUED
    frames: int = 0  # a video's sampled frames (0: an image)
    chunk: int = 0  # a video's temporal patches per vision-tower call (0: all at once)
    # the vision-tower call that encoded it (set by the encoder thread): its wall-clock start and end
    # (``time.time()``) and the keys it encoded together (``batch`` in a room's timeline)
    tower: Tower | None = None


@dataclass(frozen=True)
class Tower:
    """One vision-tower call: when it began and ended (wall clock) and the keys of its batch."""

    start: float
    end: float
    keys: tuple[str, ...]


class Batcher:
    def __init__(self, max_images: int) -> None:
        if max_images <= 0:
            raise ValueError(f"max_images must be > 0, got {max_images}")
        self.max_images = max_images
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()

    @property
    def depth(self) -> int:
        """Jobs queued, not yet taken."""
        return len(self._queue)

    def put(self, job: Job) -> None:
        with self._cond:
            if job.state is not JobState.QUEUED:
                raise ValueError(f"job {job.key} is {job.state.name}, only a QUEUED job can be put")
            self._queue.append(job)
            self._cond.notify()

    def take(self, timeout_s: float) -> list[Job]:
        """The oldest queued jobs (at most ``max_images``), now RUNNING; [] if none came within ``timeout_s``."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue, timeout_s)
            batch = [self._queue.popleft() for _ in range(min(self.max_images, len(self._queue)))]
            for job in batch:
                job.state = JobState.RUNNING
            return batch

    def cancel(self, job: Job) -> bool:
        """End ``job`` if it is still queued (True); False if a thread took it or it already ended."""
        with self._cond:
            if job.state is not JobState.QUEUED:
                return False
            self._queue.remove(job)
            job.state = JobState.ENDED
            return True

    def finish(self, job: Job) -> None:
        """Called by the encoder thread once a taken job's result is handed back."""
        with self._cond:
            job.state = JobState.ENDED


class RecentRooms:
    """The last ``capacity`` rooms added (aborted rooms: work that arrives late for one is refused)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._rooms: OrderedDict[int, None] = OrderedDict()

    def add(self, room: int) -> None:
        self._rooms[room] = None
        self._rooms.move_to_end(room)
        while len(self._rooms) > self.capacity:
            self._rooms.popitem(last=False)

    def __contains__(self, room: object) -> bool:
        return room in self._rooms
