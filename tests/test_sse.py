"""Server-sent events keep each chunk on one line for the line splitters clients use."""
import json

from httpx._decoders import LineDecoder

from numa_runtime.serve.responses import sse


def test_text_with_unicode_line_breaks_stays_one_event_line():
    text = "a\x85b\u2028c\u2029d\ne\rf\x1cg\x0bh é"
    event = sse({"choices": [{"text": text}]})
    lines = [ln for ln in LineDecoder().decode(event) if ln]   # what httpx's iter_lines yields
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):])["choices"][0]["text"] == text
    assert "é" in event  # non-ASCII text is still sent as it is


def test_done_marker_unchanged():
    assert sse("[DONE]") == "data: [DONE]\n\n"
