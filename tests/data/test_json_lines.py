"""The JSONL fast path (json_line_texts) gives parse_json_line's strings or hands the line over."""

import json

import pytest

from megalite.data.corpus import BadInput, json_line_texts, parse_json_line

ORDINARY = [  # the fast path takes these
    b'{"text": "plain"}\n', b'{"text": "crlf"}\r\n', b'{"text": "no newline"}', b'{"text":"tight"}\n',
    b'{"text": "trailing spaces"}  \t \n', b'{"text": "escapes \\n \\t \\" \\\\ \\/ \\u00e9 \\u4e2d \\ud83d\\ude00"}\n',
    "{\"text\": \"raw utf-8 \u00e9\u4e2d\U0001f600\", \"other\": \"\u00e9\"}\n".encode(),
    b'{"text": "", "other": ""}\n',
    b'{"text": "first", "text": "last wins", "other": "o"}\n',
    b'{"id": 3, "meta": {"a": [1, 2.5e3, null, true]}, "text": "t", "other": "o"}\n',
    b'{"text": "nan elsewhere", "score": NaN, "other": "o"}\n',
    b'{"text": "big int", "n": 123456789012345678901234567890, "other": "o"}\n', b'{"other": "y", "text": "x"}\n',
]
HANDED_OVER = [b'  {"text": "leading space", "other": "o"}\n', b'\t{"text": "leading tab", "other": "o"}\n']
REFUSED = [  # json.loads or parse_json_line refuses these: the fast path must hand them over
    b'{"text": "a"} x\n', b'{"text": "a"}\x0b\n', b'{"text": "a"}\xc2\xa0\n', b'{"text": "a"}}\n',
    b'{"text": "a",}\n', b'{"text": "a"\n', b'["text"]\n', b'"text"\n', b'3\n', b'null\n', b'\n', b'   \n',
    b'{"body": "no text key"}\n', b'{"text": 5}\n', b'{"text": null}\n', b'{"text": ["a"]}\n',
    b'{"text": "\xff invalid utf-8"}\n', b'{"text": "lone \\ud800 surrogate \xc3\xa9"}\n',
    b'{"text": "lone \\udc00 low"}\n', b'{"text": "raw \x01 control"}\n', b"{'text': 'single quotes'}\n",
    b'{"text": "a"}\n{"text": "b"}\n', b'{"text": "only one key"}\n',
]


def slow(raw, keys):
    try:
        return parse_json_line(raw, keys, "in.jsonl", 1)
    except BadInput:
        return None


@pytest.mark.parametrize("keys", [["text"], ["text", "other"]])
def test_fast_path_gives_the_slow_paths_strings_or_hands_the_line_over(keys):
    ordinary = [raw for raw in ORDINARY if all(f'"{key}"'.encode() in raw for key in keys)]
    assert len(ordinary) >= 7
    for raw in ordinary:
        fast = json_line_texts(raw, keys)
        assert fast is not None and fast == slow(raw, keys), raw
        assert all(type(t) is str for t in fast)
    for raw in HANDED_OVER:
        assert json_line_texts(raw, keys) is None and slow(raw, keys) is not None, raw
    for raw in REFUSED if keys == ["text", "other"] else REFUSED[:-1]:
        assert slow(raw, keys) is None, raw
        assert json_line_texts(raw, keys) is None, raw


def test_fast_path_agrees_with_json_loads_on_the_escapes_a_dump_writes():
    texts = ["tab\tnewline\nquote\"backslash\\", "\u00e9\u4e2d\U0001f600", "\x00\x1f\x7f", "</script>"]
    for text in texts:
        for ascii_only in (True, False):
            raw = (json.dumps({"text": text}, ensure_ascii=ascii_only) + "\n").encode()
            assert json_line_texts(raw, ["text"]) == [text]
