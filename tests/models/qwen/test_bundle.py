"""The causal-LM bundle: tiny tokenizer, save / load of a local directory, config and load errors."""

from __future__ import annotations

import json
import os
import string

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from unirl.models.causal_lm import TinyLMConfig, tiny_tokenizer
from unirl.models.qwen import QwenConfig, load_checkpoint


def test_tiny_tokenizer_round_trips_text_and_renders_chatml() -> None:
    tok = tiny_tokenizer()
    text = string.printable + " two  spaces, ünïcode and <|im_end|> inline"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(tok.encode("Hello, world!", add_special_tokens=False)) == len("Hello, world!")  # one per char
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        256,
        257,
        258,
    ]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [258]
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert no_prompt == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize(("arch", "cls"), [("qwen3", Qwen3ForCausalLM), ("qwen2", Qwen2ForCausalLM)])
def test_save_pretrained_loads_back_offline(tmp_path, arch, cls) -> None:
    bundle = QwenConfig(tiny=TinyLMConfig(architecture=arch, num_layers=1)).build()
    assert type(bundle.model) is cls
    bundle.save_pretrained(str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "<|im_start|>user\nhi!<|im_end|>\n"
    assert tok.encode(text) == bundle.tokenizer.encode(text)
    assert tok.decode(tok.encode(text)) == text and tok.chat_template == bundle.tokenizer.chat_template
    assert tok.eos_token_id == bundle.tokenizer.eos_token_id and tok.pad_token_id == tok.eos_token_id
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, bundle.model(ids).logits)
    again = QwenConfig(pretrained_path=str(tmp_path)).build()
    assert type(again.model) is cls and len(again.tokenizer) == len(bundle.tokenizer)


def test_tiny_build_is_deterministic_in_seed_and_leaves_global_rng() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = QwenConfig(tiny=TinyLMConfig(seed=1)).build().model
    assert torch.equal(torch.rand(1), before)  # the global RNG is untouched
    b = QwenConfig(tiny=TinyLMConfig(seed=1)).build().model
    c = QwenConfig(tiny=TinyLMConfig(seed=2)).build().model
    wa, wb, wc = (m.get_input_embeddings().weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_layers": 0}, r"model\.tiny\.num_layers must be >= 1, got 0"),
        ({"architecture": "llama"}, r"model\.tiny\.architecture must be one of"),
        ({"hidden_size": 60, "num_attention_heads": 8}, r"hidden_size=60 must be a multiple"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, r"num_key_value_heads=3"),
    ],
)
def test_tiny_config_errors_name_the_key(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        TinyLMConfig(**kwargs)


def test_model_config_errors() -> None:
    with pytest.raises(ValueError, match="exactly one of model.pretrained_path"):
        QwenConfig()
    with pytest.raises(ValueError, match="exactly one of model.pretrained_path"):
        QwenConfig(pretrained_path="/x", tiny=TinyLMConfig())
    with pytest.raises(ValueError, match="model.dtype must be one of"):
        QwenConfig(tiny=TinyLMConfig(), dtype="fp8")
    assert QwenConfig(tiny={"num_layers": 1}).tiny.num_layers == 1  # a recipe's plain dict


def test_load_errors_name_the_directory(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"model\.pretrained_path .*nope.* is not a directory"):
        QwenConfig(pretrained_path=missing).build()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty.* has no config\.json"):
        QwenConfig(pretrained_path=str(empty)).build()
    # a model with fewer embedding rows than the tokenizer has tokens
    small = tmp_path / "small"
    Qwen3ForCausalLM(
        Qwen3Config(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    ).save_pretrained(str(small))  # fmt: skip
    tiny_tokenizer().save_pretrained(str(small))
    assert os.path.isfile(small / "config.json")
    with pytest.raises(ValueError, match=r"small.*259 tokens.*100 rows"):
        QwenConfig(pretrained_path=str(small)).build()


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_write_weights_then_load_checkpoint(tmp_path, kind) -> None:
    """The backend's export (a LoRA adapter or the full state) loads back with the trained weights."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    base = QwenConfig(tiny=TinyLMConfig(num_layers=1)).build()
    base.save_pretrained(str(tmp_path / "base"))
    bundle = QwenConfig(pretrained_path=str(tmp_path / "base")).build()
    model = bundle.model
    if kind == "lora":  # as TrainBackend injects and exports it
        model.add_adapter(
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        )
        state = get_peft_model_state_dict(
            model, state_dict={n: p.detach() for n, p in model.named_parameters()}
        )
    else:
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.mul_(2)
        state = {k: v.clone() for k, v in model.state_dict().items()}
    out = tmp_path / "ckpt"
    out.mkdir()
    bundle.write_weights(str(out), kind, state, model)
    (out / "unirl_checkpoint.json").write_text(
        json.dumps({"kind": kind, "base_model": str(tmp_path / "base"), "optimizer_steps": 1})
    )
    loaded = load_checkpoint(str(out))
    ids = torch.tensor([bundle.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n")])
    with torch.no_grad():
        want, got, untrained = model(ids).logits, loaded.model(ids).logits, base.model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(got, untrained, atol=1e-3)
    assert loaded.tokenizer.encode("abc") == bundle.tokenizer.encode("abc")
    with pytest.raises(FileNotFoundError, match="is not a UniRL checkpoint"):
        load_checkpoint(str(tmp_path / "base"))
