"""Issue 52: `vlbatch inspect` shows a media's prompts on one card (caption first, then the other prompts in
prompt order) and a structured answer's parsed value as a small table (terminal: `key: value` lines; the
page: a <table> per value), every answer escaped (untrusted text). Rows in the real output schema committed
through the real sink (`inspect_support.make_run`); inspect only reads them, so no model runs."""
from __future__ import annotations

import io
import json
import re
from html.parser import HTMLParser

import pytest
from inspect_support import MODEL, RUN_ID, make_run

from vlbatch.jobs.inspect.cards import cards, parsed_items
from vlbatch.jobs.inspect.html import render
from vlbatch.jobs.inspect.run import read_run, resolve_run
from vlbatch.jobs.inspect.text import print_report
from vlbatch.operators.sink.schema import OutputRow

EVIL = '<script>alert(1)</script>\x1b[31m'  # an answer is untrusted: markup and a terminal escape sequence


def _row(uri, idx, name, prompt, *, answer=None, parsed=None, error=None):
    ok = error is None
    return OutputRow(id=f"{uri}#{idx}", request_index=idx, media_uri=uri, media_type="image", prompt=prompt,
                     prompt_name=name, status="ok" if ok else "error", model=MODEL, run_id=RUN_ID,
                     answer=answer if ok else None, parsed=parsed if ok else None,
                     error_type=None if ok else error, error_message=None if ok else "cut at 2 tokens",
                     prompt_tokens=20, visual_tokens=16, generated_tokens=2 if error else 5,
                     finish_reason="length" if error else "stop")


def _rows():
    tags = {"shapes": ["circle", "square"], "count": 2, "box": {"x": 1, "y": 2}, "note": EVIL}
    a = [  # written out of order: the card puts the caption first, then request_index order
        _row("a.png", 3, "year", "What year?", answer="1999", parsed='"1999"'),
        _row("a.png", 1, "tags", "Tag it.", answer=json.dumps(tags), parsed=json.dumps(tags)),
        _row("a.png", 4, "caption", "Describe this image.", answer="A red " + EVIL),
        _row("a.png", 0, None, "How many people?", answer="none"),
        _row("a.png", 2, "has_text", "Text?", error="TruncatedError"),
    ]
    b = [_row("b.png", 0, "has_text", "Text?", answer="no", parsed='"no"'),
         _row("b.png", 1, "caption", "Describe this image.", answer="A blue square.")]
    return a + b


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cards") / RUN_ID
    make_run(str(d), _rows())  # two part files: a.png's rows are split across them
    return d


def test_parsed_values_become_key_value_items():
    assert parsed_items(None, "x") is None
    assert parsed_items('"yes"', "has_text") == (("has_text", "yes"),)
    assert parsed_items("[1, 2]", "n") == (("n", "1, 2"),)
    got = dict(parsed_items(json.dumps({"a": {"b": True, "c": None}, "l": [{"k": 1}, 2], "e": {}}), "v"))
    assert got == {"a.b": "true", "a.c": "null", "l[0].k": "1", "l[1]": "2", "e": "{}"}
    assert parsed_items("{not json", "v") == (("v", "{not json"),)  # shown as it is, never an exception


def test_terminal_report_puts_a_medias_prompts_on_one_card(run_dir):
    rep = read_run(resolve_run(str(run_dir)), sample=8)
    out = io.StringIO()
    print_report(rep, out)
    text = out.getvalue()
    assert "sample: 2 media (7 rows) of 7 rows (seed 0)" in text, text
    card = text.split("[1] a.png  image, 4 ok, 1 error\n", 1)[1].split("[2] ", 1)[0]
    labels = re.findall(r"^    (\S+): ", card, re.M)
    assert labels == ["caption", "prompt", "tags", "has_text", "year"], card
    assert "      answer: none\n" in card
    for line in ("shapes: circle, square", "count: 2", "box.x: 1", "box.y: 2", "year: 1999"):
        assert f"      {line}\n" in card, (line, card)
    assert "      error:  TruncatedError: cut at 2 tokens" in card
    assert "\x1b" not in text and "\\x1b[31m" in card  # the escape sequence is shown, never sent
    assert "[2] b.png  image, ok\n    caption: Describe this image." in text


def test_a_sample_of_one_keeps_every_row_of_its_media(run_dir):
    picked = set()
    for seed in range(6):
        rep = read_run(resolve_run(str(run_dir)), sample=1, seed=seed)
        (card,) = cards(rep.sample)
        assert len(card.answers) == {"a.png": 5, "b.png": 2}[card.media_uri]
        picked.add(card.media_uri)
    assert picked == {"a.png", "b.png"}  # the seed picks the media
    errs = read_run(resolve_run(str(run_dir)), sample=5, where=(("status", "error"),))
    assert [len(c.answers) for c in cards(errs.sample)] == [1] and errs.matched == 1


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.scripts, self.cells, self._cell = [], 0, [], None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag in ("th", "td"):
            self._cell = ""
        self.scripts += tag == "script"

    def handle_endtag(self, tag):
        if tag in ("th", "td") and self._cell is not None:
            self.cells.append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def test_page_shows_one_card_per_media_with_parsed_tables_escaped(run_dir):
    rep = read_run(resolve_run(str(run_dir)), sample=8)
    page = render(rep, {})
    sample = re.search(r'<section id="sample"[^>]*>(.*?)</section>', page, re.S).group(1)
    assert sample.count('<div class="card') == 2
    first = sample.split('<div class="card')[1]
    names = re.findall(r'<b class="name">([^<]*)</b>', first)
    assert names == ["caption", "prompt", "tags", "has_text", "year"]
    assert first.count('<table class="parsed">') == 2  # tags and year; caption and free text stay text
    parser = _Page()
    parser.feed(page)
    assert parser.scripts == 1  # the page's own script only: the answer's <script> is text
    cells = parser.cells
    for k, v in (("shapes", "circle, square"), ("count", "2"), ("box.x", "1"), ("year", "1999")):
        i = cells.index(k)
        assert cells[i + 1] == v, cells
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in first and "TruncatedError: cut at 2 tokens" in first


def test_an_empty_json_list_shows_as_brackets_not_a_blank_cell(tmp_path):
    """Issue 60 item 13: `[]` (a list answer, or a key's) was an empty string in the terminal and the page."""
    d = tmp_path / RUN_ID
    make_run(str(d), [_row("c.png", 0, "tags", "Tag it.", answer="[]", parsed="[]"),
                      _row("c.png", 1, "box", "Box?", answer='{"labels": []}', parsed='{"labels": []}')])
    assert parsed_items("[]", "tags") == (("tags", "[]"),)
    rep = read_run(resolve_run(str(d)), sample=8)
    out = io.StringIO()
    print_report(rep, out)
    assert "      tags: []\n" in out.getvalue() and "      labels: []\n" in out.getvalue(), out.getvalue()
    parser = _Page()
    parser.feed(render(rep, {}))
    cells = parser.cells
    assert cells[cells.index("tags") + 1] == "[]" and cells[cells.index("labels") + 1] == "[]", cells
