"""Model loading: the first run's SmolLM2 conversion draws no progress bar into a redirected log; the tokenizer comes
from where the weights do; a folder of LoRA adapters loads as its merged weights."""

from __future__ import annotations

import io

from verifiers_rl.core.models import load_causal_lm, load_tokenizer, no_bars_when_redirected, resolve_model

from tests.helpers.model_folders import OTHER_TEMPLATE, a_model_in_a_subfolder


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def gguf_bar() -> None:
    # The bar transformers' GGUF reader draws while converting (its own tqdm.auto, which transformers' switch misses).
    from transformers import modeling_gguf_pytorch_utils

    for _ in modeling_gguf_pytorch_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
        pass


def test_the_conversions_progress_bar_is_not_drawn_into_a_redirected_stderr(monkeypatch):
    # A real conversion takes 30 s to minutes; its bar is this one, drawn on the stderr of the moment.
    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    gguf_bar()
    assert "\r" in log.getvalue()  # what a log file got: carriage-return frames
    log.seek(0), log.truncate()
    with no_bars_when_redirected():
        gguf_bar()
    assert log.getvalue() == ""
    gguf_bar()  # and after it, as before
    assert "\r" in log.getvalue()


def test_a_terminal_keeps_the_bar(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with no_bars_when_redirected():
        gguf_bar()
    assert "Converting and de-quantizing GGUF tensors" in terminal.getvalue()


def test_a_stderr_without_isatty_is_not_a_terminal(monkeypatch):
    """The check was ``sys.stderr.isatty()``: a stderr replaced by a writer without ``isatty`` (a logging capture)
    failed the model load with an AttributeError; it is a redirected stream, as training's show_bar already took it."""

    class Writer:  # file-like enough for tqdm, no isatty
        def __init__(self):
            self.text = ""

        def write(self, text):
            self.text += text

        def flush(self):
            pass

    writer = Writer()
    monkeypatch.setattr("sys.stderr", writer)
    with no_bars_when_redirected():
        gguf_bar()
    assert writer.text == ""


def test_the_tokenizer_follows_the_subfolder_and_revision_that_choose_the_weights(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    # The weights came from the subfolder (or revision) of model_init_kwargs, the tokenizer from the top (or main).
    from transformers import AutoTokenizer

    root = a_model_in_a_subfolder(tiny_model_dir, tmp_path / "repo")
    chosen = load_tokenizer(str(root), load_kwargs={"subfolder": "sub", "variant": "fp16", "use_safetensors": True})
    assert chosen.chat_template == (root / "sub" / "chat_template.jinja").read_text()
    assert load_tokenizer(str(root)).chat_template == OTHER_TEMPLATE
    # A revision needs a Hub repository, which this machine cannot reach: only a spy on the loader can see it.
    seen = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda name, **kwargs: seen.append(kwargs) or chosen)
    load_tokenizer(str(root), load_kwargs={"revision": "v1", "token": "t", "variant": "fp16"})
    assert seen == [{"revision": "v1", "token": "t"}]  # variant names weight files only


def test_a_home_relative_folder_of_adapters_loads_merged_as_resolve_model_takes_it(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    """load_causal_lm tested for a folder of adapters without expanding ``~``: ``~/adapters``, which resolve_model
    takes as the adapters merged into their base, went to transformers as a Hub id and failed; it loads merged."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HOME", str(tmp_path))
    lora = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj"], init_lora_weights=False)
    adapters = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    adapters.save_pretrained(tmp_path / "adapters")
    merged = dict(adapters.merge_and_unload().named_parameters())
    loaded = dict(load_causal_lm("~/adapters").named_parameters())
    assert sorted(loaded) == sorted(merged) and all(torch.equal(loaded[name], merged[name]) for name in merged)


def test_a_home_relative_model_folder_resolves_to_the_folder(tiny_model_dir, tmp_path, monkeypatch):
    """``--model=~/m`` (the shell leaves ``~`` after ``=`` alone) went to transformers unexpanded, which then said
    "'~/m' is not a folder here" of a folder that is there."""
    import shutil

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    assert resolve_model("~/m") == str(tmp_path / "m")
    assert load_tokenizer("~/m").vocab_size == load_tokenizer(tiny_model_dir).vocab_size
    assert resolve_model("org/name") == "org/name"  # a Hub id is passed on as it is
