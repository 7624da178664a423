"""Weight loads into a vLLM server, one object per transfer behind ``load(named_tensors, version)``.

- ``SnapshotLoad`` (``files``): a safetensors snapshot in a folder the server reads too, reloaded in place by our
  worker extension (``verifiers_rl/vllm_worker/vllm_weight_sync.py``), which checks it before touching anything.
- ``BroadcastLoad`` (``nccl`` / ``gloo``): vLLM's weight-transfer routes, with the tensors broadcast from this
  process (rank 0 of a ``weight_transfer.TransferGroup``) to the server's workers; no disk.

Each ``load`` consumes the stream once (every tensor taken as it is drawn: a ZeRO-3 gather may free it right
after), strips wrapper prefixes, resets the server's prefix cache (it holds keys/values of the old weights) and
returns a report of the load (``VLLMEngine.last_load``).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol

import torch

from verifiers_rl.core.modeling import strip_wrappers
from verifiers_rl.vllm_worker.vllm_weight_sync import check_entries
from verifiers_rl.core.engine import free_port
from verifiers_rl.inference.vllm.http import ServerInfo, VLLMError, VLLMRequestError, VLLMTransport
from verifiers_rl.inference.vllm.weight_transfer import TransferGroup, address_towards

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightLoad(Protocol):
    """How one ``VLLMEngine`` sends weights to its server."""

    def load(self, named_tensors: NamedTensors, version: int) -> dict:
        """Load the pairs into the server; return a report (``tensors``, ``total_s``, ``version``, ...)."""

    def reload(self) -> dict | None:
        """Load the last loaded weights again (kept with ``keep_last``; a restarted server); None if none kept."""

    def close(self) -> None:
        """Release what the transfer holds (a group, a temporary folder)."""


@dataclass
class Snapshot:
    """A written ``files`` snapshot: its folder, manifest and version."""

    folder: Path
    manifest: Path
    version: int
    write_s: float


class SnapshotLoad:
    """``files``: one safetensors file per tensor in ``weights_dir`` (default: a temporary folder, removed with
    this object), then one ``verifiers_rl_load_snapshot`` RPC; the snapshot is deleted once loaded, unless
    ``keep_last``: then the last loaded one stays on disk (one snapshot at rest, two while the next is written) so
    ``reload()`` can give a restarted server the current weights.

    The server's extension checks every name and shape against its checkpoint first and answers a rejection
    (unknown, missing or misshapen tensors) without loading anything: ``VLLMRequestError``, old weights kept.
    A failure during the reload itself (rare: I/O) leaves the server's weights inconsistent; its error says to
    restart it.
    """

    def __init__(self, http: VLLMTransport, weights_dir: str | Path | None = None, keep_last: bool = False):
        self.http = http
        self._weights_dir = Path(weights_dir) if weights_dir is not None else None
        self._cleanup = None
        self.keep_last = keep_last
        self.current: Snapshot | None = None  # the last loaded snapshot, when kept

    @property
    def weights_dir(self) -> Path:
        """Where snapshots are written (made on first use)."""
        if self._weights_dir is None:
            self._weights_dir = Path(tempfile.mkdtemp(prefix="vllm-weights-"))
            # Removed at close(), garbage collection or interpreter exit, whichever comes first.
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self._weights_dir), True)
        self._weights_dir.mkdir(parents=True, exist_ok=True)
        return self._weights_dir

    def load(self, named_tensors: NamedTensors, version: int) -> dict:
        snapshot = self.write(named_tensors, version)
        try:
            return self.send(snapshot)
        finally:
            self.release(snapshot)

    def write(self, named_tensors: NamedTensors, version: int) -> Snapshot:
        """Write the pairs as a snapshot (nothing sent yet)."""
        from safetensors.torch import save_file

        started = time.perf_counter()
        folder = Path(tempfile.mkdtemp(prefix=f"v{int(version)}-", dir=self.weights_dir))
        try:
            entries = []
            for index, (key, tensor) in enumerate(plain_names(named_tensors)):
                file_name = f"{index:05d}.safetensors"
                # One file per tensor, written before the next tensor is drawn: nothing of the model is buffered.
                save_file({key: tensor.detach().to("cpu").contiguous()}, str(folder / file_name))
                entries.append({"name": key, "file": file_name, "shape": list(tensor.shape)})
            if not entries:
                raise ValueError("load_weights got no tensors.")
            manifest = folder / "manifest.json"
            manifest.write_text(json.dumps({"version": int(version), "tensors": entries}))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return Snapshot(folder, manifest, int(version), time.perf_counter() - started)

    def send(self, snapshot: Snapshot) -> dict:
        """Have the server load ``snapshot`` (may be called again after a failure: the files are unchanged)."""
        started = time.perf_counter()
        result = self.http.rpc("verifiers_rl_load_snapshot", str(snapshot.manifest.resolve()))[0]
        result = result if isinstance(result, dict) else {"result": result}
        if result.get("rejected"):
            raise VLLMRequestError(
                f"Weights rejected, nothing loaded: the vLLM server at {self.http.base_url} serves "
                f"{result.get('checkpoint')}, which has other parameters: " + "; ".join(result["rejected"])
            )
        self.http.request("POST", "/reset_prefix_cache")
        if self.keep_last and snapshot is not self.current:
            previous, self.current = self.current, snapshot
            if previous is not None:
                shutil.rmtree(previous.folder, ignore_errors=True)
        return {**result, "write_s": snapshot.write_s, "total_s": snapshot.write_s + time.perf_counter() - started,
                "version": snapshot.version, "transfer": "files"}

    def release(self, snapshot: Snapshot) -> None:
        """Delete ``snapshot`` unless it is the one kept."""
        if snapshot is not self.current:
            shutil.rmtree(snapshot.folder, ignore_errors=True)

    def reload(self) -> dict | None:
        """Load the kept snapshot again (a restarted server); None when none is kept."""
        return None if self.current is None else self.send(self.current)

    def close(self) -> None:
        if self.current is not None:
            shutil.rmtree(self.current.folder, ignore_errors=True)
            self.current = None
        if self._cleanup is not None:
            self._cleanup()


class BroadcastLoad:
    """``nccl`` / ``gloo``: vLLM's weight-transfer protocol. ``/start_weight_update``; per round of about
    ``bucket_bytes``, one ``/update_weights`` (names, dtypes, shapes) while this process broadcasts the round's
    tensors; then ``/finish_weight_update`` (always, so the server leaves its reload state even after an error).

    Each round is checked against the served checkpoint's names and shapes before it is sent (a rejected round
    is never broadcast, so nothing waits for it); a parameter missing at the end is an error too. Unlike
    ``files``, rounds before a rejected one are already loaded: after an error the server may hold a mix (the
    trainer stops; restart the server or load a full set again).

    Args:
        http: the server. ``server``: what connecting learnt (checkpoint shapes, tied embeddings, workers).
        backend: ``"nccl"`` or ``"gloo"``. ``address``: where the server's workers reach this process
            (default: the interface that routes to the server). ``timeout_s``: the group's bound on a collective.
        keep_last: keep a CPU copy of the last loaded weights (host memory: the model's size) so ``reload()`` can
            give a restarted server the current weights.
    """

    def __init__(self, http: VLLMTransport, server: ServerInfo, backend: str, address: str | None = None,
                 bucket_bytes: int = 256 * 2**20, timeout_s: float = 600.0, keep_last: bool = False):
        self.keep_last = keep_last
        self._kept: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        self.http = http
        self.server = server
        self.backend = backend
        self.address = address
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = timeout_s
        self._group: TransferGroup | None = None
        self._owner_token = uuid.uuid4().hex  # names this client's group on the server's workers
        # Runs the HTTP side of a round while this thread broadcasts (both must be under way at once).
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-transfer-http")

    def load(self, named_tensors: NamedTensors, version: int) -> dict:
        if not self.keep_last:
            return self._load(named_tensors, version)
        kept: list[tuple[str, torch.Tensor]] = []

        def copying():
            for name, tensor in plain_names(named_tensors):
                kept.append((name, tensor.detach().to("cpu", copy=True)))
                yield name, tensor

        report = self._load(copying(), version)
        self._kept = (int(version), kept)
        return report

    def reload(self) -> dict | None:
        """Send the kept copy again (a restarted server); None when none is kept."""
        if self._kept is None:
            return None
        version, kept = self._kept
        return self._load(iter(kept), version)

    def _load(self, named_tensors: NamedTensors, version: int) -> dict:
        started = time.perf_counter()
        group = self._transfer_group()
        sent: dict[str, list[int]] = {}
        rounds = 0
        self.http.request("POST", "/start_weight_update", retry_5xx=False)
        try:
            for bucket in _rounds(plain_names(named_tensors), group.stage, self.bucket_bytes):
                given = {name: list(tensor.shape) for name, tensor in bucket}
                self._check(given, f"Weights rejected by the check against {self.http.base_url}'s checkpoint "
                            f"before sending (after {len(sent)} tensors were loaded)", require_all=False)
                self._send_round(group, bucket)
                sent.update(given)
                rounds += 1
            if not sent:
                raise ValueError("load_weights got no tensors.")
            self._check(sent, f"Weights incomplete for {self.http.base_url}'s checkpoint (what was sent is loaded)")
        except BaseException:
            try:
                self.http.request("POST", "/finish_weight_update", retries=0, retry_5xx=False)
            except VLLMError:
                pass  # the first error is the one to report
            raise
        self.http.request("POST", "/finish_weight_update", retry_5xx=False)
        self.http.request("POST", "/reset_prefix_cache")
        return {"tensors": len(sent), "rounds": rounds, "total_s": time.perf_counter() - started,
                "version": int(version), "transfer": self.backend}

    def _check(self, given: dict[str, list[int]], what: str, require_all: bool = True) -> None:
        expected = self.server.checkpoint_shapes
        if not expected:  # a server that could not read its checkpoint's files: vLLM's loader still checks
            return
        problems = check_entries(expected, given, bool(self.server.tie_word_embeddings), require_all=require_all)
        if problems:
            raise VLLMRequestError(f"{what}: " + "; ".join(problems))

    def _send_round(self, group: TransferGroup, bucket: list[tuple[str, torch.Tensor]]) -> None:
        update_info = {
            "names": [name for name, _ in bucket],
            "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket],
            "shapes": [list(tensor.shape) for _, tensor in bucket],
        }
        # The server's workers wait in their broadcasts inside this request: it must be under way while we send.
        answered = self._pool.submit(self.http.request, "POST", "/update_weights", {"update_info": update_info},
                                     retries=0, retry_5xx=False)
        try:
            handles = [group.broadcast(tensor) for _, tensor in bucket]
            group.wait(handles, failed=lambda: _failure(answered))
        except BaseException as error:
            self._drop_group()  # a half-sent round leaves the group unusable
            if isinstance(error, (VLLMError, KeyboardInterrupt)):
                raise
            try:  # a dropped connection usually means the server died or refused the round: its answer says which
                answered.result(timeout=5)
            except VLLMError as answer:
                raise answer from error
            except Exception:  # noqa: BLE001 - no better explanation than the broadcast's own
                pass
            raise VLLMError(
                f"Sending weights to the vLLM server at {self.http.base_url} over {self.backend} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        answered.result()

    def _transfer_group(self) -> TransferGroup:
        """The trainer + workers group, opened on first use: the workers join from inside
        ``/init_weight_transfer_engine`` while this process serves the rendezvous (rank 0).

        Reopened when the workers are no longer in ours (a restarted server, or another client that opened its
        own since): broadcasting into a group nobody listens to would wait out the timeout. One trainer per server.
        """
        if self._group is not None:
            owners = self.http.rpc("verifiers_rl_transfer_owner", retries=0)
            if all(owner == self._owner_token for owner in owners):
                return self._group
            logger.warning("The vLLM server at %s left this client's weight-transfer group (restarted, or another "
                           "client joined it to its own); opening a new one.", self.http.base_url)
            self._drop_group()
        address = self.address or address_towards(self.http.host)
        port = free_port(address)
        world_size = 1 + self.server.workers
        init_info = {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": world_size,
                     "packed": False}
        self.http.rpc("verifiers_rl_transfer_owner", self._owner_token, retries=0)
        joined = self._pool.submit(self.http.request, "POST", "/init_weight_transfer_engine",
                                   {"init_info": init_info}, retries=0, retry_5xx=False)
        # Opened on a thread of its own: if the server refuses, we say so now instead of waiting out the rendezvous.
        opener = ThreadPoolExecutor(1, thread_name_prefix="vllm-transfer-open")
        cuda_device = torch.cuda.current_device() if self.backend == "nccl" else None  # required: CUDA
        opened = opener.submit(TransferGroup.open, self.backend, address, port, world_size, self.timeout_s,
                               cuda_device)
        opener.shutdown(wait=False)
        try:
            while not opened.done():
                error = _failure(joined)
                if error is not None:
                    raise VLLMError(
                        f"The vLLM server at {self.http.base_url} could not join the {self.backend} weight-transfer "
                        f"group at {address}:{port}: {error}"
                    ) from error
                time.sleep(0.01)
            group = opened.result()
            joined.result()
        except BaseException:
            if opened.done() and opened.exception() is None:
                opened.result().close()
            raise
        self._group = group  # only once both sides joined: a failed open leaves no closed group behind to reuse
        return group

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def close(self) -> None:
        self._kept = None
        self._drop_group()
        self._pool.shutdown(wait=False)


def plain_names(named_tensors: NamedTensors) -> NamedTensors:
    """The pairs with wrapper prefixes removed; a name given twice is an error."""
    seen = set()
    for name, tensor in named_tensors:
        key = strip_wrappers(name)
        if key in seen:
            raise ValueError(f"Weight {key!r} was given twice.")
        seen.add(key)
        yield key, tensor


def _rounds(pairs: NamedTensors, stage, bucket_bytes: int):
    """Lists of staged (copied) pairs of about ``bucket_bytes`` each: a round's metadata is sent before its
    tensors, so the round must be drawn from the stream (and copied: drawn tensors are freed) first."""
    bucket, size = [], 0
    for name, tensor in pairs:
        copy = stage(tensor)
        bucket.append((name, copy))
        size += copy.numel() * copy.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _failure(future: Future) -> BaseException | None:
    return future.exception() if future.done() else None
