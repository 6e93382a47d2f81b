"""Chat niceties: code blocks highlighted (Pygments) with a Copy button; Markdown while
the answer streams (not only at the end), re-rendering only the block being written."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtGui import QGuiApplication  # noqa: E402

from colibri_app.chat_view import MessageView  # noqa: E402
from colibri_app.history import COMPLETE, STREAMING, Message  # noqa: E402

ANSWER = """Use the **csv** module:

```python
import csv
with open("data.csv", newline="") as f:
    for row in csv.DictReader(f):
        print(row["name"])
```

Then `csv.reader` gives lists.

~~~
plain block
~~~
"""


def _card(qtbot, text="", status=STREAMING):
    v = MessageView(Message(1, 1, "assistant", text, status))
    qtbot.addWidget(v)
    v.resize(600, 400)
    v.show()
    return v


def _stream(v, text, step=3):
    for i in range(0, len(text), step):
        v.append_stream(text[i:i + step])


def _formats(doc):
    """(text, foreground colour) of every fragment of a document."""
    out = []
    b = doc.begin()
    while b.isValid():
        it = b.begin()
        while not it.atEnd():
            f = it.fragment()
            out.append((f.text(), f.charFormat().foreground().color().name()))
            it += 1
        b = b.next()
    return out


def test_code_block_is_highlighted_with_a_copy_button(qtbot):
    v = _card(qtbot, ANSWER, COMPLETE)
    [py, plain] = v.code_blocks
    assert py.lang == "python" and py.lang_label.text() == "python"
    assert py.code == 'import csv\nwith open("data.csv", newline="") as f:\n    for row in csv.DictReader(f):\n' \
                      '        print(row["name"])'
    colours = {c for t, c in _formats(py.view.document()) if t.strip()}
    assert len(colours) >= 3, colours          # keywords, strings, names: not one colour
    assert plain.code == "plain block" and plain.lang_label.text() == "code"
    assert py.copy_btn.isVisibleTo(v) and py.copy_btn.text() == "Copy code"
    py.copy_btn.click()
    assert QGuiApplication.clipboard().text() == py.code
    assert py.copy_btn.text() == "Copied"
    qtbot.waitUntil(lambda: py.copy_btn.text() == "Copy code", timeout=1_800_000)
    # the prose around the code is Markdown (bold, inline code), not literal asterisks
    prose = v.text.widgets[0]
    assert "**" not in prose.toPlainText() and "csv" in prose.toPlainText()
    assert any(f[0] == "csv" for f in _formats(prose.document()))
    # the message's own Copy still copies the whole answer
    v.copy_btn.click()


def test_markdown_renders_while_streaming(qtbot):
    v = _card(qtbot)
    _stream(v, "Some **bold** text and a list:\n\n- one\n- two\n\n```python\nx = 1\ny = ")
    assert v.status == STREAMING
    kinds = [b.kind for b in v.text.blocks]
    assert kinds == ["prose", "code"]
    prose = v.text.widgets[0].toPlainText()
    assert "**" not in prose and "bold" in prose          # rendered, not shown as typed
    [code] = v.code_blocks
    assert code.code == "x = 1\ny = " and not code.final
    assert len({c for t, c in _formats(code.view.document()) if t.strip()}) >= 2   # highlighted already


def test_streamed_answer_ends_like_a_rendered_one(qtbot):
    streamed = _card(qtbot)
    _stream(streamed, ANSWER, step=2)
    streamed.set_content(ANSWER, COMPLETE)
    fresh = _card(qtbot, ANSWER, COMPLETE)
    assert streamed.text.blocks == fresh.text.blocks
    assert [w.toPlainText() for w in streamed.text.widgets] == [w.toPlainText() for w in fresh.text.widgets]
    for a, b in zip(streamed.code_blocks, fresh.code_blocks):
        assert _formats(a.view.document()) == _formats(b.view.document())


def test_streaming_cost_stays_flat_on_long_answers(qtbot):
    """Each update re-renders only the block being written: the Markdown handed to Qt per
    update is bounded by the chunk size, not by the length of the answer."""
    from colibri_app.markdown_view import PROSE_CHUNK, PROSE_HARD
    para = "This paragraph explains one more thing about the csv module in some detail. " * 4 + "\n\n"
    code = "```python\n" + "".join(f"value_{i} = compute({i})  # step {i}\n" for i in range(40)) + "```\n\n"
    text = (para * 6 + code) * 8                              # ~30 k characters
    v = _card(qtbot)
    body = v.text
    per_update = []
    step = 12                                                 # ~ a few tokens per 40 ms flush
    for i in range(0, len(text), step):
        before = body.rendered_chars
        v.append_stream(text[i:i + step])
        per_update.append(body.rendered_chars - before)
    assert max(per_update) <= PROSE_HARD + 2 * len(para)
    total_md = body.rendered_chars
    updates = len(per_update)
    # re-rendering everything each time would hand ~updates * len/2 characters to Qt
    assert total_md < updates * PROSE_CHUNK * 1.2 < updates * len(text) / 2 / 5
    lexed = sum(c.highlighted_chars for c in v.code_blocks)
    code_chars = sum(len(c.code) for c in v.code_blocks)
    assert lexed <= code_chars + 8 * len(code)                # streamed lines are lexed once each
    v.set_content(text, COMPLETE)
    assert len(v.code_blocks) == 8 and all(c.final for c in v.code_blocks)
