"""The loader's whole pipeline in a child process: ``gpufeed.loader(..., process=True)``.

On the GPU paths the process that drives the model also runs the decoding's host side: nvImageCodec takes and
gives back the interpreter lock for every image of a batch (header parse, output buffer), and the crop builds
per-image tensors, all on the lock the training loop's own thread needs to launch the model's kernels. In a
child process none of that shares the training loop's interpreter. The child runs an ordinary :class:`Loader`
(DataLoader workers, decoders, crops) and copies each batch into one of a few slots it allocated once; the
slots reach this process once, through CUDA IPC (shared memory on the CPU), and each batch is then only a slot
number on a queue. This process copies the slot into a batch of its own on a side stream and hands the slot back
once that copy has run, so a batch stays valid as long as the caller keeps it.

Protocol (the queues carry tuples):

* parent -> child: ``("epoch", generation, epoch)`` start an epoch (abandoning one in progress),
  ``("slot", i)`` slot ``i`` may be written again, ``("stop",)``;
* child -> parent: ``("ring", tensors)`` once, ``("batch", generation, slot, n, cpu_share)``,
  ``("end", generation)``, ``("error", exception_or_None, traceback_text)``.

A batch of an abandoned generation (the caller stopped iterating an epoch) is handed straight back.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
import weakref
from collections.abc import Iterator

from gpufeed.errors import ConfigError

#: Batches the child may hold ready ahead of the consumer (each a slot of the batch's size on the device).
SLOTS = 4
#: How often a side waiting on a queue checks that the other side is alive (seconds).
_POLL_S = 1.0


class FeederError(RuntimeError):
    """The loader's child process failed; the message carries its traceback."""


def _child_main(kwargs: dict, slots: int, inbound, outbound) -> None:
    """The child: a :class:`~gpufeed.pipelines.loader.Loader` (``process=False``) fed through the ring."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    try:
        import torch
        import torch.multiprocessing  # noqa: F401  (registers the pickling of CUDA and shared-memory tensors)

        from gpufeed.pipelines.loader import Loader

        loader = Loader(**kwargs)
        cuda = loader.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(loader.device)
        free: list[int] = []
        ring = None
        start = None  # the ("epoch", generation, epoch) command to run next

        def receive(block: bool):
            """The parent's next message; None when there is none and ``block`` is false. A parent that is gone
            reads as ("stop",)."""
            while True:
                try:
                    return inbound.get(timeout=_POLL_S) if block else inbound.get_nowait()
                except queue.Empty:
                    if parent is not None and not parent.is_alive():
                        return ("stop",)
                    if not block:
                        return None

        def take(block: bool) -> str | None:
            """Handles one message: a slot joins the free list, an epoch command is kept in ``start``. Returns the
            message's kind, or None when there was none."""
            nonlocal start
            msg = receive(block)
            if msg is None:
                return None
            if msg[0] == "slot":
                free.append(msg[1])
            elif msg[0] == "epoch":
                start = msg
            return msg[0]

        while True:
            while start is None:
                if take(True) == "stop":
                    return
            _, generation, epoch = start
            start = None
            loader.set_epoch(epoch)
            abandoned = False
            for batch in loader:
                if ring is None:
                    ring = [[torch.empty((loader.batch_size, *t.shape[1:]), dtype=t.dtype, device=t.device)
                             for t in batch] for _ in range(slots)]
                    if not cuda:
                        for tensors in ring:
                            for t in tensors:
                                t.share_memory_()
                    free.extend(range(slots))
                    outbound.put(("ring", ring))
                # Every message waiting is taken before a batch goes out; with no slot free, the next one is awaited.
                while (kind := take(not free)) is not None:
                    if kind == "stop":
                        return
                    if kind == "epoch":
                        abandoned = True
                        break
                if abandoned:
                    break
                slot = free.pop()
                n = batch[0].shape[0]
                for target, t in zip(ring[slot], batch):
                    target[:n].copy_(t, non_blocking=True)
                if cuda:
                    torch.cuda.current_stream().synchronize()
                outbound.put(("batch", generation, slot, n, loader.cpu_share))
            else:
                outbound.put(("end", generation))
    except BaseException as exc:  # noqa: BLE001 (everything goes to the parent, which raises it)
        text = traceback.format_exc()
        try:
            import pickle

            pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            exc = None
        outbound.put(("error", exc, text))


def _hand_back(returns, inbound) -> None:
    """A slot goes back to the child once the copy out of it has run on the GPU (a thread of the parent)."""
    while True:
        item = returns.get()
        if item is None:
            return
        event, slot = item
        if event is not None:
            event.synchronize()
        try:
            inbound.put(("slot", slot))
        except (ValueError, OSError):
            return  # closed meanwhile


class ProcessFeed:
    """A loader's batches made in a child process (see this module). ``kwargs`` are the
    :class:`~gpufeed.pipelines.loader.Loader`'s own (without ``process``); ``device`` the consumer's device."""

    def __init__(self, kwargs: dict, device, slots: int = SLOTS):
        import torch
        import torch.multiprocessing as tmp

        if slots < 2:
            raise ConfigError(f"the loader's child process needs at least 2 slots, not {slots}")
        self.torch, self.device = torch, device
        ctx = tmp.get_context("spawn")  # CUDA cannot be used in a forked child of a process that has used it
        self.inbound, self.outbound = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_child_main, args=(kwargs, slots, self.inbound, self.outbound),
                                name="gpufeed-loader", daemon=False)  # a daemon could not start DataLoader workers
        self.proc.start()
        self.generation = 0
        self.cpu_share = None
        self.ring: list | None = None  # per slot, one tensor per element of a batch (x, y)
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._returns: queue.SimpleQueue = queue.SimpleQueue()
        self._returner = threading.Thread(target=_hand_back, args=(self._returns, self.inbound),
                                          name="gpufeed-feed-return", daemon=True)
        self._returner.start()
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.inbound, self._returns)

    def _receive(self):
        while True:
            try:
                msg = self.outbound.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise FeederError(f"the loader's child process exited with code {self.proc.exitcode} "
                                      "before it sent a batch (killed for memory? its output is above)") from None
                continue
            if msg[0] == "error":
                _, exc, text = msg
                if exc is not None:
                    raise exc from FeederError(f"in the loader's child process:\n{text}")
                raise FeederError(f"the loader's child process failed:\n{text}")
            if msg[0] == "ring":
                self.ring = msg[1]
                continue
            return msg

    def epoch(self, epoch: int) -> Iterator:
        """The batches of ``epoch``, as the in-process loader would yield them."""
        torch = self.torch
        self.generation += 1
        generation = self.generation
        self.inbound.put(("epoch", generation, epoch))
        while True:
            msg = self._receive()
            if msg[1] != generation:  # a batch or the end of an epoch the caller stopped reading
                if msg[0] == "batch":
                    self._returns.put((None, msg[2]))
                continue
            if msg[0] == "end":
                return
            _, _, slot, n, self.cpu_share = msg
            sources = [t[:n] for t in self.ring[slot]]
            if self.cuda:
                main = torch.cuda.current_stream(self.device)
                with torch.cuda.stream(self.stream):
                    out = [s.clone() for s in sources]
                    done = torch.cuda.Event()
                    done.record(self.stream)
                main.wait_event(done)
                for t in out:
                    t.record_stream(main)
                self._returns.put((done, slot))
            else:
                out = [s.clone() for s in sources]
                self._returns.put((None, slot))
            yield tuple(out)

    def close(self) -> None:
        self.ring = None  # the consumer's mappings go before the producer exits
        self._finalizer()


def _stop(proc, inbound, returns, timeout: float = 10.0) -> None:
    returns.put(None)
    try:
        inbound.put(("stop",))
    except (ValueError, OSError):
        pass
    deadline = time.monotonic() + timeout
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(max(0.0, deadline - time.monotonic()) or 1.0)
