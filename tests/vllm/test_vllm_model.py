"""`kpool-pd vllm-model`: the runnable model folder of the README's vLLM commands. Its tokenizer encodes any
text within the model's vocabulary and decodes it back, its chat template renders, and the command refuses
a folder that holds something else (status 2, naming it)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers", reason="the tokenizer is made with tokenizers (vLLM brings it)")
transformers = pytest.importorskip("transformers", reason="vLLM loads the tokenizer through transformers")
pytest.importorskip("safetensors", reason="the weights are written with safetensors")

from kpool_pd.bench.vllm_engines import TINY_LLAMA  # noqa: E402
from kpool_pd.cli import main  # noqa: E402


def test_the_folder_runs_text_through_its_tokenizer(tmp_path, capsys):
    folder = tmp_path / "tiny-llama"
    assert main(["vllm-model", str(folder)]) == 0
    assert str(folder) in capsys.readouterr().out
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                  "tokenizer_config.json"}
    config = json.loads((folder / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = "Hello, wörld! 你好 \n\t<s>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert max(ids) < config["vocab_size"] == TINY_LLAMA["vocab_size"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<s>user: hi\nassistant:"
    assert main(["vllm-model", str(folder)]) == 0  # its own folder: written again


def test_a_folder_with_other_files_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["vllm-model", str(tmp_path)]) == 2
    assert "other files" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
