"""Prompt file loading and data-source batching (CPU only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unirl.data import (
    DEFAULT_PROMPTS,
    DefaultDataSource,
    ListDataSource,
    PromptDataSource,
    PromptFileError,
    load_prompts,
)
from unirl.types import PromptExample

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def _jsonl(tmp_path: Path, rows: list, name: str = "p.jsonl") -> str:
    return _write(tmp_path, name, "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


# ---- formats -----------------------------------------------------------------


def test_txt_strips_and_skips_blank_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, "p.txt", "  a red circle \n\n\na blue square\n   \n")
    assert load_prompts(path) == [
        PromptExample("a red circle", "p.txt:0", {}),
        PromptExample("a blue square", "p.txt:1", {}),
    ]


def test_jsonl_schema(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path,
        [
            {"prompt": "a", "prompt_id": "x", "metadata": {"k": 1}},
            "",
            {"caption": "b"},
            {"prompt": "c", "tag": "t", "count": 2, "prompt_id": 7},
        ],
    )
    assert load_prompts(path) == [
        PromptExample("a", "x", {"k": 1}),
        PromptExample("b", "p.jsonl:1", {}),
        PromptExample("c", "7", {"tag": "t", "count": 2}),
    ]


def test_custom_prompt_key_takes_precedence_over_caption(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, [{"text": "a", "caption": "ignored", "src": "s"}, {"caption": "b"}])
    examples = load_prompts(path, prompt_key="text")
    assert [e.prompt for e in examples] == ["a", "b"]
    assert examples[0].metadata == {"src": "s"}


def test_json_list_of_strings_and_objects(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "p.json", json.dumps(["a", {"prompt": "b", "prompt_id": "id-b"}, {"caption": "c"}])
    )
    assert load_prompts(path) == [
        PromptExample("a", "p.json:0", {}),
        PromptExample("b", "id-b", {}),
        PromptExample("c", "p.json:2", {}),
    ]


def test_json_dict_with_prompts(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "p.json", json.dumps({"prompts": [{"prompt": "a", "metadata": {"m": 1}}], "name": "x"})
    )
    assert load_prompts(path) == [PromptExample("a", "p.json:0", {"m": 1})]


# ---- errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    "row, fragments",
    [
        ('{"prompt": "a", ', ["line 2", "invalid JSON"]),
        ('["a"]', ["line 2", "list", "expected a JSON object"]),
        ('"a bare string"', ["line 2", "str", "expected a JSON object"]),
        ({"tag": "x"}, ["line 2", "no prompt text", "'prompt'", "caption"]),
        ({"prompt": "  "}, ["line 2", "'prompt' is empty"]),
        ({"caption": 3}, ["line 2", "'caption' must be a string", "int"]),
        ({"prompt": "a", "metadata": [1]}, ["line 2", "metadata must be a JSON object", "list"]),
        (
            {"prompt": "a", "metadata": {}, "tag": 1},
            ["line 2", "extra top-level keys ['tag']", "inside 'metadata'"],
        ),
        ({"prompt": "a", "prompt_embeds": [0.1]}, ["line 2", "prompt_embeds", "not supported"]),
        ({"prompt": "a", "prompt_embed_path": "e.pt"}, ["line 2", "prompt_embed_path", "not supported"]),
        ({"prompt": "a", "prompt_id": None}, ["line 2", "prompt_id must be"]),
        (
            {"prompt": "a", "prompt_id": "first"},
            ["line 2", "duplicate prompt_id 'first'", "first used at line 1"],
        ),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, row: object, fragments: list[str]) -> None:
    path = _jsonl(tmp_path, [{"prompt": "ok", "prompt_id": "first"}, row])
    with pytest.raises(PromptFileError) as err:
        load_prompts(path)
    msg = str(err.value)
    assert path in msg
    for fragment in fragments:
        assert fragment in msg, msg


def test_jsonl_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, "p.jsonl", '{"prompt": "a"}\n\n\n{"prompt": ""}\n')
    with pytest.raises(PromptFileError, match=r"p\.jsonl, line 4: 'prompt' is empty"):
        load_prompts(path)


def test_default_id_colliding_with_explicit_id_is_a_duplicate(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, [{"prompt": "a", "prompt_id": "p.jsonl:1"}, {"prompt": "b"}])
    with pytest.raises(PromptFileError, match="line 2: duplicate prompt_id 'p.jsonl:1'"):
        load_prompts(path)


@pytest.mark.parametrize(
    "doc, fragments",
    [
        (["a", 5], ["entry 1", "int", "expected a string or a JSON object"]),
        (["a", ""], ["entry 1", "prompt is empty"]),
        (["a", {"caption": None}], ["entry 1", "'caption' must be a string"]),
        (["a", {"prompt": "b", "metadata": "x"}], ["entry 1", "metadata must be a JSON object"]),
        (
            ["a", {"prompt": "b", "prompt_id": "p.json:0"}],
            ["entry 1", "duplicate prompt_id", "first used at entry 0"],
        ),
        ({"items": ["a"]}, ["no 'prompts' key", "['items']"]),
        ({"prompts": "a"}, ["expected a list", "str"]),
        (3, ["expected a list", "int"]),
    ],
)
def test_json_errors_name_file_and_entry(tmp_path: Path, doc: object, fragments: list[str]) -> None:
    path = _write(tmp_path, "p.json", json.dumps(doc))
    with pytest.raises(PromptFileError) as err:
        load_prompts(path)
    msg = str(err.value)
    assert path in msg
    for fragment in fragments:
        assert fragment in msg, msg


def test_json_syntax_error_names_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "p.json", '[\n  "a",\n  "b"\n  "c"\n]\n')
    with pytest.raises(PromptFileError, match=r"p\.json, line 4: invalid JSON"):
        load_prompts(path)


@pytest.mark.parametrize(
    "name, text", [("e.txt", "\n  \n"), ("e.jsonl", ""), ("e.json", "[]"), ("e2.json", "")]
)
def test_empty_file(tmp_path: Path, name: str, text: str) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(PromptFileError, match=f"{name}: file has no prompts"):
        load_prompts(path)


def test_unknown_extension_lists_accepted(tmp_path: Path) -> None:
    path = _write(tmp_path, "p.csv", "a\n")
    with pytest.raises(PromptFileError) as err:
        load_prompts(path)
    assert all(s in str(err.value) for s in (path, "'.csv'", ".txt", ".jsonl", ".json"))


def test_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.txt")
    with pytest.raises(PromptFileError, match="nope.txt: prompt file not found"):
        load_prompts(path)
    with pytest.raises(PromptFileError, match="not found"):
        PromptDataSource(path)


def test_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_bytes(b"a red \xff circle\n")
    with pytest.raises(PromptFileError, match="not valid UTF-8"):
        load_prompts(str(path))


# ---- batching ----------------------------------------------------------------


def _source(n: int, shuffle: bool = True, seed: int = 0) -> ListDataSource:
    return ListDataSource([PromptExample(f"p{i}", str(i)) for i in range(n)], shuffle=shuffle, seed=seed)


def _ids(batch: list[PromptExample]) -> list[int]:
    return [int(e.prompt_id) for e in batch]


def test_unshuffled_epoch_boundary_drops_partial_batch() -> None:
    src = _source(10, shuffle=False)
    batches = [_ids(src.next_batch(4)) for _ in range(4)]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]
    assert src.epoch == 1


def test_shuffled_epoch_is_a_permutation_and_drops_remainder() -> None:
    src = _source(10, seed=3)
    epoch0 = [_ids(src.next_batch(3)) for _ in range(3)]
    assert src.epoch == 0
    assert len({i for b in epoch0 for i in b}) == 9
    first_of_epoch1 = _ids(src.next_batch(3))
    assert src.epoch == 1 and src.position == 3

    full = _source(10, seed=3)
    assert _ids(full.next_batch(10))[:9] == [i for b in epoch0 for i in b]
    assert _ids(full.next_batch(10))[:3] == first_of_epoch1


def test_shuffle_deterministic_per_seed_and_differs_across_epochs() -> None:
    a, b, c = _source(16, seed=7), _source(16, seed=7), _source(16, seed=8)
    ea = [_ids(a.next_batch(16)) for _ in range(3)]
    eb = [_ids(b.next_batch(16)) for _ in range(3)]
    ec = [_ids(c.next_batch(16)) for _ in range(3)]
    assert ea == eb
    assert ea != ec
    assert ea[0] != ea[1] != ea[2]
    assert all(sorted(e) == list(range(16)) for e in ea)
    assert ea[0] != list(range(16))


def test_batches_are_copies() -> None:
    src = ListDataSource([PromptExample("a", "0", {"k": 1})], shuffle=False)
    src.next_batch(1)[0].metadata["k"] = 2
    assert src.next_batch(1)[0].metadata == {"k": 1}


@pytest.mark.parametrize("steps", [0, 1, 2, 3, 5])
def test_state_dict_resume_is_identical(steps: int) -> None:
    src = _source(10, seed=5)
    for _ in range(steps):
        src.next_batch(3)
    state = src.state_dict()
    expected = [_ids(src.next_batch(3)) for _ in range(8)]

    resumed = _source(10, seed=5)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    assert [_ids(resumed.next_batch(3)) for _ in range(8)] == expected


def test_load_state_dict_rejects_mismatched_source() -> None:
    state = _source(10, seed=5).state_dict()
    with pytest.raises(ValueError, match="seed: saved 5 vs now 6"):
        _source(10, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="num_prompts: saved 10 vs now 11"):
        _source(11, seed=5).load_state_dict(state)


def test_batch_larger_than_dataset_raises(tmp_path: Path) -> None:
    path = _write(tmp_path, "p.txt", "a\nb\nc\n")
    src = PromptDataSource(path)
    assert len(src) == 3
    src.next_batch(3)
    with pytest.raises(ValueError) as err:
        src.next_batch(4)
    assert all(s in str(err.value) for s in ("prompts_per_rollout=4", "3 prompts", path))
    with pytest.raises(ValueError, match="prompts_per_rollout must be >= 1"):
        src.next_batch(0)


def test_default_data_source() -> None:
    src = DefaultDataSource(seed=1)
    assert len(src) == len(DEFAULT_PROMPTS) == 16
    batch = src.next_batch(16)
    assert sorted(e.prompt for e in batch) == sorted(DEFAULT_PROMPTS)
    assert {e.prompt_id for e in batch} == {f"default:{i}" for i in range(16)}
    with pytest.raises(ValueError, match="prompts_per_rollout=17 exceeds the 16 prompts"):
        src.next_batch(17)
    unshuffled = DefaultDataSource(shuffle=False)
    assert [e.prompt for e in unshuffled.next_batch(4)] == list(DEFAULT_PROMPTS[:4])


# ---- committed files ---------------------------------------------------------


def test_smoke_txt_loads() -> None:
    src = PromptDataSource(str(REPO / "datasets/smoke/prompts.txt"), shuffle=False)
    assert len(src) >= 8
    assert src.next_batch(1)[0] == PromptExample("a red circle", "prompts.txt:0", {})


def test_smoke_jsonl_loads() -> None:
    examples = load_prompts(str(REPO / "datasets/smoke/prompts.jsonl"))
    by_id = {e.prompt_id: e for e in examples}
    assert by_id["red-circle"].metadata == {"color": "red", "shape": "circle"}
    assert by_id["green-triangle"].prompt == "a green triangle"
    assert any(e.metadata.get("tag") == "counting" for e in examples)


def test_image_rows_resolve_their_files_against_the_prompt_file(tmp_path: Path) -> None:
    sub = tmp_path / "data"
    sub.mkdir()
    f = sub / "vqa.jsonl"
    f.write_text(
        '{"prompt": "<image>how many?", "images": ["img/a.png"], "answer": "2"}\n'
        '{"prompt": "<image>colour?", "images": ["/abs/b.png"], "answer": "red"}\n'
    )
    rows = load_prompts(str(f))
    assert rows[0].metadata == {"images": [str(sub / "img" / "a.png")], "answer": "2"}
    assert rows[1].metadata["images"] == ["/abs/b.png"]
    f.write_text('{"prompt": "<image>q", "images": "a.png"}\n')
    with pytest.raises(PromptFileError, match=r"vqa.jsonl, line 1: 'images' must be a list of image file paths"):
        load_prompts(str(f))
def test_path_keys_resolve_other_image_lists_against_the_prompt_file(tmp_path) -> None:
    """An edit row's `source` resolves like `images` when it is one of `path_keys`; a malformed one
    is named with its key and line."""
    from unirl.data.datasets import PromptFileError, load_prompts

    path = tmp_path / "edits.jsonl"
    path.write_text('{"prompt": "make it red", "source": ["a.png"]}\n')
    (ex,) = load_prompts(str(path), path_keys=("images", "source"))
    assert ex.metadata["source"] == [str(tmp_path / "a.png")]
    (plain,) = load_prompts(str(path))
    assert plain.metadata["source"] == ["a.png"]  # not a path key: left as written
    path.write_text('{"prompt": "make it red", "source": "a.png"}\n')  # one file: resolved as one
    (one,) = load_prompts(str(path), path_keys=("source",))
    assert one.metadata["source"] == str(tmp_path / "a.png")
    path.write_text('{"prompt": "make it red", "source": ["a.png", 3]}\n')
    with pytest.raises(PromptFileError, match=r"line 1: 'source' must be an image file path or a list of them"):
        load_prompts(str(path), path_keys=("source",))
