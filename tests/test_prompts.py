"""Tests for jaxrl.data.prompts: loading prompt sets from JSONL/Parquet files, and prompt batches."""

import json
import logging
import re

import grain
import pytest

from jaxrl.data.batching import shuffled_batches
from jaxrl.data.prompts import PromptFields, PromptRecord, load_prompts, prompt_batches

GSM8K = PromptFields("question", "answer", template="Q: {prompt}\nA:", reference_pattern=r"#### (.+)$")
MATH = PromptFields("problem", "solution", template="{prompt} Put the answer in \\boxed{{}}.",
                    reference_from="boxed")
CODE = PromptFields("prompt", "tests")


def write_jsonl(path, rows):
    """Rows are dicts (JSON-encoded) or raw strings (written verbatim as one line)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------
# Good rows
# ---------------------------------------------------------------------------


def test_a_byte_order_mark_does_not_cost_the_first_row(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"question": "1+1?", "answer": "#### 2"}).encode() + b"\n")
    records, skipped = load_prompts(path, GSM8K)
    assert (skipped, [r.reference for r in records]) == (0, ["2"])


def test_gsm8k_rows(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
        "",  # blank lines are ignored but still counted for line numbers
        {"question": "What is 1000 + 234?", "answer": "#### 1,234", "id": 5},
    ])
    records, skipped = load_prompts(path, GSM8K)
    assert skipped == 0
    assert records == [
        PromptRecord("Q: Tom has 3 apples and buys 4. How many?\nA:", "7", f"{path}:1"),
        PromptRecord("Q: What is 1000 + 234?\nA:", "1,234", f"{path}:3"),
    ]


def test_math_rows(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", [
        {"problem": "Compute $\\frac{1}{2}+\\frac{1}{4}$.", "solution": "We get $\\boxed{\\frac{3}{4}}$."},
        {"problem": "Solve {x}: x^2=4, x>0.", "solution": "x = 2, so \\boxed{2}."},
    ])
    records, _ = load_prompts(str(path), MATH)
    assert [r.reference for r in records] == ["\\frac{3}{4}", "2"]
    assert records[0].prompt == "Compute $\\frac{1}{2}+\\frac{1}{4}$. Put the answer in \\boxed{}."
    assert records[1].prompt.startswith("Solve {x}: x^2=4")  # braces in the prompt text are kept as-is


def test_code_rows_and_non_string_references(tmp_path):
    tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]
    path = write_jsonl(tmp_path / "code.jsonl", [
        {"prompt": "Read two ints, print their sum.", "tests": tests},
        {"prompt": "Echo.", "tests": {"input": ["a\n", "b\n"], "output": ["a\n", "b\n"]}},  # APPS form
        {"prompt": "Write f.", "tests": [{"assert": "assert f(2) == 4", "input": None, "output": None}]},
        {"prompt": "Answer with a number.", "tests": 42},
    ])
    records, _ = load_prompts(path, CODE)
    assert json.loads(records[0].reference) == {"tests": tests}
    assert records[0].reference == json.dumps({"tests": tests})
    # The APPS dict of lists becomes the list of {input, output} pairs code_reward runs (it scores a dict 0).
    assert json.loads(records[1].reference) == {"tests": [{"input": "a\n", "output": "a\n"},
                                                          {"input": "b\n", "output": "b\n"}]}
    assert json.loads(records[2].reference) == {"tests": [{"assert": "assert f(2) == 4"}]}  # Parquet-style nulls
    assert records[3].reference == "42"


def test_apps_references_earn_the_reward_of_the_list_form(tmp_path):
    from jaxrl.rewards import code_reward

    path = write_jsonl(tmp_path / "code.jsonl", [
        {"prompt": "Echo a line.", "tests": {"input": ["a\n"], "output": ["a\n"]}},
        {"prompt": "Echo a line.", "tests": [{"input": "a\n", "output": "a\n"}]},
    ])
    records, _ = load_prompts(path, CODE)
    completion = "```python\nprint(input())\n```"
    assert [code_reward(completion, r.reference) for r in records] == [1.0, 1.0]


def test_default_fields(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q?", "answer": " a "}])
    assert load_prompts(path) == ([PromptRecord("q?", "a", f"{path}:1")], 0)


# ---------------------------------------------------------------------------
# Bad rows
# ---------------------------------------------------------------------------

BAD_ROWS = [
    # (line, fields, expected message after "<path>:<line>: ")
    ('{"question": "q", "answer": "#### 1"', GSM8K, "invalid JSON"),
    ("[1, 2]", GSM8K, "expected a JSON object, got list"),
    ('"just a string"', GSM8K, "expected a JSON object, got str"),
    ({"answer": "#### 1", "id": 3}, GSM8K, "field 'question' missing (row keys: answer, id)"),
    ({"question": "q"}, GSM8K, "field 'answer' missing (row keys: question)"),
    ({"question": 17, "answer": "#### 1"}, GSM8K, "field 'question' must be a string, got int"),
    ({"question": None, "answer": "#### 1"}, GSM8K, "field 'question' is null"),
    ({"question": "  ", "answer": "#### 1"}, GSM8K, "field 'question' is empty"),
    ({"question": "q", "answer": "the answer is 1"}, GSM8K,
     "field 'answer' does not match reference_pattern '#### (.+)$'"),
    ({"question": "q", "answer": 1}, GSM8K,
     "field 'answer' must be a string to extract the reference from, got int"),
    ({"question": "q", "answer": "####    "}, GSM8K, "field 'answer' gives an empty reference"),
    ({"problem": "p", "solution": "no answer here"}, MATH, "no answer found in field 'solution'"),
    ({"prompt": "p", "tests": True}, CODE, "field 'tests' has unsupported type bool"),
    ({"prompt": "p", "tests": float("nan")}, CODE, "field 'tests' is nan, not a finite number"),
    ({"prompt": "p", "tests": float("inf")}, CODE, "field 'tests' is inf, not a finite number"),
    # Code tests code_reward cannot run (it would score them 0 forever).
    ({"prompt": "p", "tests": []}, CODE, "field 'tests' has no tests"),
    ({"prompt": "p", "tests": {"input": [], "output": []}}, CODE, "field 'tests' has no tests"),
    ({"prompt": "p", "tests": {"input": ["1"], "output": ["1", "2"]}}, CODE,
     "field 'tests': 'input' has 1 items but 'output' has 2"),
    ({"prompt": "p", "tests": {"inputs": ["1"], "outputs": ["1"]}}, CODE,
     "field 'tests': an object must be {\"input\": [...], \"output\": [...]} (lists of strings), got keys "
     "inputs, outputs"),
    ({"prompt": "p", "tests": {"input": "1", "output": "1"}}, CODE, "field 'tests': an object must be"),
    ({"prompt": "p", "tests": ["1", "2"]}, CODE,
     "field 'tests' test 0 must have string 'input' and 'output' or a string 'assert', got '1'"),
    ({"prompt": "p", "tests": [{"input": "1", "output": "1"}, {"input": "1", "output": 1}]}, CODE,
     "field 'tests' test 1 must have string 'input' and 'output' or a string 'assert'"),
    ({"prompt": "p", "tests": {"input": [1], "output": ["1"]}}, CODE,
     "field 'tests' test 0 must have string 'input' and 'output' or a string 'assert'"),
    # Lone surrogates (valid JSON escapes, invalid Unicode): tokenizers and programs fail on them.
    ({"question": "smile \ud83d then 2+2=", "answer": "#### 4"}, GSM8K,
     "field 'question' has a lone surrogate '\\ud83d' at character 6 (invalid Unicode)"),
    ({"question": "q", "answer": "#### 4 \udc00"}, GSM8K,
     "field 'answer' has a lone surrogate '\\udc00' at character 7"),
    ({"prompt": "p", "tests": [{"input": "1", "output": "1"}, {"assert": "assert '\ud800'"}]}, CODE,
     "field 'tests' test 1 'assert' has a lone surrogate '\\ud800' at character 8"),
]


@pytest.mark.parametrize("bad,fields,message", BAD_ROWS, ids=[m for _, _, m in BAD_ROWS])
def test_bad_row_errors_name_file_line_and_field(tmp_path, bad, fields, message):
    good = {"question": "q", "answer": "#### 1", "problem": "p", "solution": "\\boxed{1}", "prompt": "p",
            "tests": [{"assert": "assert True"}]}
    path = write_jsonl(tmp_path / "train.jsonl", [good, "", bad, good])
    with pytest.raises(ValueError) as info:
        load_prompts(path, fields)
    assert str(info.value).startswith(f"{path}:3: {message}")
    # The same file with skip_bad_rows loses exactly that row.
    records, skipped = load_prompts(path, fields, skip_bad_rows=True)
    assert skipped == 1
    assert [r.source for r in records] == [f"{path}:1", f"{path}:4"]


def test_invalid_utf8_line(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "a"}\n{"question": "\xff"}\n')
    with pytest.raises(ValueError, match=r"u\.jsonl:2: invalid UTF-8"):
        load_prompts(path)


def test_skip_bad_rows_counts_and_logs(tmp_path, caplog):
    rows = [{"question": "q", "answer": "#### 1"}] + ["not json"] * 8 + [{"answer": "#### 2"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="jaxrl.data.prompts"):
        records, skipped = load_prompts(path, GSM8K, skip_bad_rows=True)
    assert len(records) == 1 and skipped == 9
    messages = [r.getMessage() for r in caplog.records]
    assert sum("skipping bad prompt row" in m for m in messages) == 5  # only the first few
    assert f"{path}:2: invalid JSON" in messages[0]
    assert any("skipped 9 bad rows of 10" in m for m in messages)


def test_all_rows_bad_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ["{", "{"])
    with pytest.raises(ValueError, match=r"no prompts loaded from .*bad\.jsonl \(2 bad rows skipped\)"):
        load_prompts(path, skip_bad_rows=True)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="no prompts loaded"):
        load_prompts(empty)


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        load_prompts(tmp_path / "nope.jsonl")
    csv = tmp_path / "train.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"suffix '\.csv' is not one of \.jsonl, \.parquet"):
        load_prompts(csv)


@pytest.mark.parametrize(
    "template", ["no field", "{prompt} {0}", "{}", "{prompt", "{prompt:d}", "{prompt.x}", "{choices!r}",
                 "{prompt[0]}", "{prompt}}"]
)
def test_invalid_template(template):
    with pytest.raises(ValueError, match="invalid prompt template " + re.escape(repr(template))):
        PromptFields(template=template)


def test_invalid_reference_options():
    with pytest.raises(ValueError, match="invalid reference_pattern"):
        PromptFields(reference_pattern="(")
    with pytest.raises(ValueError, match="capture group"):
        PromptFields(reference_pattern="####")
    with pytest.raises(ValueError, match="reference_from"):
        PromptFields(reference_from="last")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reference_pattern needs reference_from='field'"):
        PromptFields(reference_pattern="(x)", reference_from="boxed")


# ---------------------------------------------------------------------------
# Parquet
# ---------------------------------------------------------------------------


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    jsonl_rows = [
        {"prompt": "Sum two ints.", "tests": [{"input": "1 2", "output": "3"}]},
        {"prompt": "Echo.", "tests": [{"input": "a", "output": "a"}, {"input": "b", "output": "b"}]},
    ]
    jsonl_path = write_jsonl(tmp_path / "code.jsonl", jsonl_rows)
    parquet_path = tmp_path / "code.parquet"
    pq.write_table(pa.Table.from_pylist(jsonl_rows), parquet_path)
    from_jsonl, _ = load_prompts(jsonl_path, CODE)
    from_parquet, skipped = load_prompts(parquet_path, CODE)
    assert skipped == 0
    assert [(r.prompt, r.reference) for r in from_parquet] == [(r.prompt, r.reference) for r in from_jsonl]
    assert [r.source for r in from_parquet] == [f"{parquet_path}:row 0", f"{parquet_path}:row 1"]


def test_parquet_bad_rows_name_row_index(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "gsm8k.parquet"
    table = pa.table({"question": ["a?", None, "c?"], "answer": ["#### 1", "#### 2", "three"]})
    pq.write_table(table, path)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:row 1: field 'question' is null$"):
        load_prompts(path, GSM8K)
    records, skipped = load_prompts(path, GSM8K, skip_bad_rows=True)
    assert skipped == 2 and [r.reference for r in records] == ["1"]
    wrong_type = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"question": [1, 2], "answer": ["#### 1", "#### 2"]}), wrong_type)
    message = f"{wrong_type}:row 0: field 'question' must be a string, got int"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_prompts(wrong_type, GSM8K)


# ---------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------


def _records(n):
    return [PromptRecord(f"p{i}", str(i), f"f:{i + 1}") for i in range(n)]


def test_prompt_batches_deterministic_and_complete():
    records = _records(10)
    take = lambda it, k: [[r.reference for r in next(it)] for _ in range(k)]  # noqa: E731
    a, b = take(prompt_batches(records, 5, seed=3), 6), take(prompt_batches(records, 5, seed=3), 6)
    assert a == b
    assert take(prompt_batches(records, 5, seed=4), 6) != a
    assert all(len(batch) == 5 for batch in a)
    assert sorted(a[0] + a[1]) == sorted(r.reference for r in records)  # first epoch covers every record


def test_prompt_batches_shards_split_the_global_batch():
    records = _records(12)
    single = next(prompt_batches(records, 6, seed=1))
    shards = [next(prompt_batches(records, 3, seed=1, shard=(i, 2))) for i in range(2)]
    assert sorted(r.reference for s in shards for r in s) == sorted(r.reference for r in single)
    assert not {r.reference for r in shards[0]} & {r.reference for r in shards[1]}


def test_prompt_batches_checkpoint_restore():
    records = _records(7)
    it = prompt_batches(records, 3, seed=0)
    next(it), next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    restored = prompt_batches(records, 3, seed=0)
    restored.set_state(state)
    assert [next(restored) for _ in range(4)] == expected


def test_run_seeds_draw_unrelated_orders_in_every_epoch():
    """grain shuffles epoch e with its seed + e: passed as they are, seed 1's first epoch was seed 0's second.
    No epoch order of eight seeds repeats another's (20 items: 20! orders), and seed 0 keeps grain's own."""
    items = list(range(20))
    orders = {}
    for seed in range(8):
        batches = shuffled_batches(items, len(items), seed)
        for epoch in range(4):
            orders.setdefault(tuple(next(batches)), []).append((seed, epoch))
    assert all(len(found) == 1 for found in orders.values()), [f for f in orders.values() if len(f) > 1]
    first = next(iter(grain.MapDataset.source(items).shuffle(seed=0).batch(20, batch_fn=list)))
    assert next(shuffled_batches(items, len(items), 0)) == first


def test_shuffled_batches_validation():
    with pytest.raises(ValueError, match="batch_size"):
        shuffled_batches([1], 0, seed=0)
    with pytest.raises(ValueError, match="empty"):
        shuffled_batches([], 2, seed=0)


def test_a_damaged_parquet_file_is_named(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1 this is not really parquet")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: not a readable Parquet file \(after 0 rows\)"):
        load_prompts(path, GSM8K)


# ---------------------------------------------------------------------------
# Templates over any row field; the row and the solution on the record
# ---------------------------------------------------------------------------

MCQ = PromptFields("question", "answer", template="{question}\n\nChoices: {choices}\n{prompt} (n={n})")


def test_templates_use_any_row_field(tmp_path):
    row = {"question": "Pick one.", "choices": ["A", "B é"], "n": 2, "answer": "A", "meta": {"id": 7}}
    path = write_jsonl(tmp_path / "mcq.jsonl", [row])
    (record,), _ = load_prompts(path, MCQ)
    # {prompt} is the prompt field's text; a string as it is, a list or number as JSON.
    assert record.prompt == 'Pick one.\n\nChoices: ["A", "B é"]\nPick one. (n=2)'
    assert record.row == row and record.messages is None and record.solution is None


def test_a_template_without_prompt_does_not_need_the_prompt_field(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"problem": "1+1", "answer": "2"}])
    (record,), _ = load_prompts(path, PromptFields(template="Solve: {problem}"))
    assert record.prompt == "Solve: 1+1"


@pytest.mark.parametrize("bad,message", [
    ({"question": "q", "n": 1, "answer": "A"}, "template field 'choices' missing (row keys: answer, n, question)"),
    ({"question": "q", "choices": None, "n": 1, "answer": "A"}, "template field 'choices' is null"),
    ({"question": "q", "choices": "x", "n": float("nan"), "answer": "A"}, "template field 'n' is nan"),
    ({"question": "q", "choices": "\ud800", "n": 1, "answer": "A"}, "template field 'choices' has a lone surrogate"),
])
def test_a_missing_template_field_is_that_rows_error(tmp_path, bad, message):
    good = {"question": "q", "choices": "x", "n": 1, "answer": "A"}
    path = write_jsonl(tmp_path / "mcq.jsonl", [good, bad, good])
    with pytest.raises(ValueError) as info:
        load_prompts(path, MCQ)
    assert str(info.value).startswith(f"{path}:2: {message}")
    records, skipped = load_prompts(path, MCQ, skip_bad_rows=True)
    assert skipped == 1 and [r.source for r in records] == [f"{path}:1", f"{path}:3"]


def test_records_with_rows_stay_hashable_and_compare_without_the_row():
    a = PromptRecord("p", "1", "f:1", {"x": [1]})
    b = PromptRecord("p", "1", "f:1", {"x": [2]})
    chat = PromptRecord("p", "1", "f:2", {}, ({"role": "user", "content": "p"},), "1")
    assert a == b and hash(a) == hash(b) and len({a, b, chat}) == 2
    assert "row=" not in repr(a)  # errors and logs stay one line


def test_solution_field(tmp_path):
    rows = [{"question": "1+1", "answer": "2", "worked": "1+1=2"}, {"question": "2+2", "answer": "4"},
            {"question": "3+3", "answer": "6", "worked": None}]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    records, _ = load_prompts(path, PromptFields(solution="worked"))
    assert [r.solution for r in records] == ["1+1=2", None, None]  # a row may lack one
    for bad, message in (({"question": "q", "answer": "1", "worked": 3}, "field 'worked' (the solution) must be "
                          "a string, got int"), ({"question": "q", "answer": "1", "worked": " "},
                                                  "field 'worked' (the solution) is empty")):
        path = write_jsonl(tmp_path / "bad.jsonl", [bad])
        with pytest.raises(ValueError, match=re.escape(f"{path}:1: {message}")):
            load_prompts(path, PromptFields(solution="worked"))


# ---------------------------------------------------------------------------
# Chat `messages` rows
# ---------------------------------------------------------------------------

CHAT = PromptFields(format="messages")
SYSTEM = {"role": "system", "content": "Be brief."}


def _chat(*turns, **extra):
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


def test_messages_rows(tmp_path):
    rows = [
        {"messages": [SYSTEM, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "id": 1},
        _chat(("user", "1+1?"), ("assistant", "2"), ("user", "times 3?"), ("assistant", "#### 6")),
        _chat(("user", "3+3?"), answer="6"),  # no assistant message: the reference field gives the reference
        _chat(("user", "5+5?"), ("assistant", "#### 10"), answer="ten"),  # the reference field wins
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    records, skipped = load_prompts(path, CHAT)
    assert skipped == 0
    first, multi, unanswered, both = records
    assert first.messages == (SYSTEM, {"role": "user", "content": "2+2?"})
    assert (first.prompt, first.reference, first.solution, first.row) == ("2+2?", "4", "4", rows[0])
    # Every message before the LAST assistant message is the prompt conversation.
    assert [m["content"] for m in multi.messages] == ["1+1?", "2", "times 3?"]
    assert (multi.prompt, multi.reference, multi.solution) == ("times 3?", "#### 6", "#### 6")
    assert (unanswered.messages, unanswered.reference, unanswered.solution) == (
        ({"role": "user", "content": "3+3?"},), "6", None)
    assert (both.reference, both.solution) == ("ten", "#### 10")
    # reference_pattern / reference_from apply to the last assistant message as they do to a field.
    gsm = PromptFields(format="messages", reference="none", reference_pattern=r"#### (.+)$")
    assert load_prompts(write_jsonl(tmp_path / "g.jsonl", rows[1:2]), gsm)[0][0].reference == "6"
    boxed = PromptFields(format="messages", reference="none", reference_from="boxed")
    row = _chat(("user", "q"), ("assistant", "so \\boxed{12}."))
    assert load_prompts(write_jsonl(tmp_path / "b.jsonl", [row]), boxed)[0][0].reference == "12"


def test_messages_from_another_field_and_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [{"conversation": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    (record,), _ = load_prompts(tmp_path / "c.parquet", PromptFields(format="messages", messages="conversation"))
    assert (record.messages, record.solution, record.source) == (
        ({"role": "user", "content": "hi"},), "yo", f"{tmp_path / 'c.parquet'}:row 0")


BAD_CHATS = [
    ({"other": 1}, "field 'messages' missing (row keys: other)"),
    ({"messages": "hi"}, "field 'messages' must be a list of messages, got str"),
    ({"messages": []}, "field 'messages' is an empty conversation"),
    ({"messages": ["hi"]}, "field 'messages' message 0 must be an object with 'role' and 'content', got str"),
    (_chat(("tool", "x")), "field 'messages' message 0 has role 'tool', not one of system, user, assistant"),
    ({"messages": [{"content": "x"}]}, "field 'messages' message 0 has role None"),
    ({"messages": [{"role": "user", "content": None}]}, "field 'messages' message 0 (user) content must be a "
                                                        "string, got NoneType"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "field 'messages' message 0 (user) content must be a string, got list"),
    (_chat(("user", "  ")), "field 'messages' message 0 (user) has empty content"),
    (_chat(("user", "q"), ("assistant", "")), "field 'messages' message 1 (assistant) has empty content"),
    (_chat(("user", "q"), ("system", "s"), ("assistant", "a")),
     "field 'messages' message 1 is a system message after the first message"),
    (_chat(("assistant", "a")), "field 'messages': the last assistant message (message 0) must follow a user "
                                "message, not nothing"),
    (_chat(("system", "s"), ("assistant", "a")), "field 'messages': the last assistant message (message 1) must "
                                                  "follow a user message, not message 0 (system)"),
    (_chat(("user", "q"), ("assistant", "a"), ("assistant", "b")),
     "field 'messages': the last assistant message (message 2) must follow a user message, not message 1 (assistant)"),
    (_chat(("system", "s")), "field 'messages': the conversation must end with a user message, not message 0 (system)"),
    (_chat(("user", "q \udc00")), "field 'messages' message 0 (user) content has a lone surrogate"),
    (_chat(("user", "q")), "field 'answer' missing"),  # no assistant answer and no reference field
]


@pytest.mark.parametrize("bad,message", BAD_CHATS, ids=[m for _, m in BAD_CHATS])
def test_bad_messages_rows_name_file_line_and_what_is_wrong(tmp_path, bad, message):
    good = _chat(("user", "q"), ("assistant", "a"))
    path = write_jsonl(tmp_path / "chat.jsonl", [good, bad, good])
    with pytest.raises(ValueError) as info:
        load_prompts(path, CHAT)
    assert str(info.value).startswith(f"{path}:2: {message}")
    records, skipped = load_prompts(path, CHAT, skip_bad_rows=True)
    assert skipped == 1 and len(records) == 2


def test_messages_options_that_do_not_apply_are_refused():
    with pytest.raises(ValueError, match="template 'Q: {prompt}' applies to format 'prompt' rows"):
        PromptFields(format="messages", template="Q: {prompt}")
    with pytest.raises(ValueError, match="solution field 'worked' applies to format 'prompt' rows"):
        PromptFields(format="messages", solution="worked")
    with pytest.raises(ValueError, match="format must be 'prompt' or 'messages'"):
        PromptFields(format="chat")  # type: ignore[arg-type]
