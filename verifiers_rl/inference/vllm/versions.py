"""Per-token weight versions from a vLLM server: which loaded weights sampled each completion token, exactly, while
weights are loaded into a server that keeps generating (continuous generation, ``--groups_in_flight``).

vLLM labels the weights it serves (``POST /update_weight_version``) and returns, with each output of its
token-in-token-out route ``POST /inference/v1/generate``, the spans of output tokens each label sampled. A load is
wrapped as pause -> load -> label -> resume: ``POST /pause?mode=keep`` freezes the running requests in place (their
keys/values kept), so no engine step runs between the load and its label, and the label of a token is the version of
the weights that sampled it. Chat requests are rendered first (``POST /v1/chat/completions/render``: the server's chat
template, the same prompt ids and sampling parameters as ``/v1/chat/completions``), then generated the same way.

The server needs ``--enable-scale-out`` (the generate and render routes) and ``VLLM_SERVER_DEV_MODE=1`` (pause,
labels); ``verifiers-rl vllm-serve`` starts it with both.
"""

from __future__ import annotations

import contextlib
import json
from typing import Iterator

from verifiers_rl.core.sampling import Sample, rollout_sampling
from verifiers_rl.inference.vllm.http import VLLMError, VLLMTransport

GENERATE = "/inference/v1/generate"
RENDER_CHAT = "/v1/chat/completions/render"
SERVER_FLAGS = "--enable-scale-out and VLLM_SERVER_DEV_MODE=1 (verifiers-rl vllm-serve starts it with both)"
# The OpenAI fields of a completions request that are not vLLM sampling parameters.
_NOT_SAMPLING = ("model", "stream", "return_token_ids", "n", "prompt", "messages", "tools", "chat_template_kwargs",
                 "add_generation_prompt", "top_logprobs")


class TokenVersions:
    """One server's weight labels and its token-in-token-out route (see the module docstring)."""

    def __init__(self, http: VLLMTransport):
        self.http = http

    def check(self, model: str | None, version: int) -> None:
        """Verify the generate route answers with version spans, then label the served weights ``version``; raises
        ``VLLMError`` naming the server flag that is missing."""
        probe = {"token_ids": [0], "sampling_params": {"max_tokens": 1, "logprobs": 0}, "model": model}
        try:
            data = self.http.request("POST", GENERATE, probe, retries=0)
        except VLLMError as error:
            if error.status in (403, 404):
                raise VLLMError(
                    f"Continuous generation (--groups_in_flight) records which weights sampled each token, through "
                    f"vLLM's {GENERATE} route, which the server at {self.http.base_url} does not offer "
                    f"(HTTP {error.status}): start it with {SERVER_FLAGS}."
                ) from error
            raise
        if "weight_versions" not in _choice(data, self.http.base_url):
            raise VLLMError(f"The vLLM server at {self.http.base_url} answers {GENERATE} without weight_versions; "
                            "per-token versions need vLLM >= 0.32.")
        self.label(version)

    def label(self, version: int) -> None:
        """Label the weights the server holds now ``version`` (the tokens they sample from now on carry it)."""
        try:
            self.http.request("POST", "/update_weight_version", {"new_version": str(int(version))})
        except VLLMError as error:
            if error.status == 404:
                raise VLLMError(f"The vLLM server at {self.http.base_url} has no /update_weight_version route: "
                                f"start it with {SERVER_FLAGS}.") from error
            raise

    @contextlib.contextmanager
    def swap(self, version: int) -> Iterator[None]:
        """Around a weight load: the server paused with its requests kept, labelled ``version`` once the load
        succeeded (a failed load keeps the old label: ``files`` leaves the old weights), resumed in every case."""
        self.http.request("POST", "/pause?mode=keep")
        try:
            yield
            self.label(version)
        except BaseException:
            with contextlib.suppress(VLLMError):  # the load's error is the one to report
                self.http.request("POST", "/resume", retries=0)
            raise
        self.http.request("POST", "/resume")

    @staticmethod
    def request(prompt_ids: list[int], payload: dict) -> dict:
        """The generate request of ``prompt_ids`` for the same sampling as a ``/v1/completions`` payload."""
        return {"token_ids": prompt_ids, "sampling_params": _sampling_params(payload), "model": payload.get("model")}

    @staticmethod
    def rendered(request: dict, payload: dict) -> dict:
        """A rendered chat request (``RENDER_CHAT``'s answer to ``payload``) with every sampling parameter of
        ``payload`` said explicitly: the render leaves out values equal to vLLM's own defaults (``max_tokens`` 16),
        which the generate route would then fill in from the server's (the rest of the context)."""
        return {**request, "sampling_params": {**request.get("sampling_params", {}), **_sampling_params(payload)}}

    def sample(self, data: dict, max_new_tokens: int) -> Sample:
        """A ``Sample`` of a generate answer: tokens, sampler log-probs and each token's version from its spans,
        which the calling rollout's ``RolloutSampling`` (a contextvar of the caller's task) records."""
        choice = _choice(data, self.http.base_url)
        try:
            token_ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(entry["logprob"]) for entry in choice["logprobs"]["content"]]
            spans = choice["weight_versions"] or []
            finish = choice["finish_reason"]
        except (KeyError, TypeError, ValueError) as error:
            raise VLLMError(f"The vLLM server at {self.http.base_url} answered {GENERATE} without token ids, "
                            f"log-probs or weight versions ({error!r}): {json.dumps(data)[:500]}") from error
        if finish not in ("stop", "length"):
            raise VLLMError(f"The vLLM server at {self.http.base_url} ended a sample with finish_reason={finish!r}.")
        sample = Sample(token_ids, logprobs, finish, self._versions(spans, len(token_ids)))
        sample.validate(max_new_tokens)
        if (rollout := rollout_sampling()) is not None:
            rollout.record_versions(sample.versions)
        return sample

    def _versions(self, spans: list[dict], count: int) -> list[int]:
        versions: list[int] = []
        for span in spans:
            if span.get("start") != len(versions) or not str(span.get("version")).lstrip("-").isdigit():
                raise VLLMError(
                    f"The vLLM server at {self.http.base_url} returned weight-version spans {spans} that do not label "
                    f"the tokens one after another with this trainer's versions (another client relabelled it, or it "
                    f"restarted unlabelled?)")
            versions += [int(span["version"])] * (int(span["end"]) - int(span["start"]))
        if len(versions) != count:
            raise VLLMError(f"The vLLM server at {self.http.base_url} labelled {len(versions)} of {count} tokens "
                            f"with a weight version ({spans}).")
        return versions


def _sampling_params(payload: dict) -> dict:
    # chat's logprobs=True / top_logprobs=0 are the chosen token's log-prob, as completions' logprobs=0
    params = {k: v for k, v in payload.items() if k not in _NOT_SAMPLING}
    return {**params, "logprobs": 0}


def _choice(data, base_url: str) -> dict:
    try:
        return data["choices"][0]
    except (KeyError, IndexError, TypeError) as error:
        raise VLLMError(f"The vLLM server at {base_url} answered {GENERATE} without a choice: "
                        f"{json.dumps(data)[:500]}") from error
