"""Stop strings over generated tokens (edge.textstream, BUGS.md S1), with a toy tokenizer
whose tokens are given byte strings."""
from edge.textstream import TextStream


class Toy:
    def __init__(self, pieces):
        self.pieces = pieces

    def token_to_piece(self, t):
        return self.pieces[t]


def _run(pieces, stop, final=True):
    ts = TextStream(Toy(pieces), stop)
    out = []
    for t in range(len(pieces)):
        r = ts.push(t)
        out.append((r.text, r.tokens, r.stopped))
        if r.stopped:
            return out, ts
    if final:
        r = ts.finish()
        out.append((r.text, r.tokens, r.stopped))
    return out, ts


def test_stop_split_over_tokens_is_never_streamed():
    out, ts = _run([b"Hello", b" wor", b"ld", b"!\n", b"##", b"#", b" more"], ["###"])
    # "\n##" could start "###": held back; the third '#' decides it
    assert out == [("Hello", [0], False), (" wor", [1], False), ("ld", [2], False), ("!\n", [3], False),
                   ("", [], False), ("", [], True)]
    assert ts.text == "Hello world!\n" and ts.stopped


def test_held_prefix_released_when_it_is_not_a_stop():
    out, ts = _run([b"a#", b"#b", b"c"], ["###"])
    assert out == [("a", [], False), ("##b", [0, 1], False), ("c", [2], False), ("", [], False)]
    assert ts.text == "a##bc" and not ts.stopped


def test_stop_inside_one_token_cuts_it_and_drops_the_rest():
    out, ts = _run([b"x", b"yz<|end|>tail"], ["<|end|>"])
    assert out[-1] == ("yz", [], True) and ts.text == "xyz"


def test_earliest_of_several_stops_and_tokens_of_multibyte_characters():
    euro = "€".encode()
    out, ts = _run([euro[:2], euro[2:] + b"AB", b"C"], ["BC", "B"])
    assert out[0] == ("", [], False)                     # half a character: nothing yet
    assert out[1] == ("€A", [0], True)                   # token 1 holds the stop: never reported
    assert ts.text == "€A" and ts.stopped
    assert ts.matched == "B"                             # the one that cut the text (Anthropic's stop_sequence)


def test_matched_names_the_earliest_stop_and_is_none_without_one():
    _, ts = _run([b"one END two STOP"], ["STOP", "END"])
    assert ts.matched == "END" and ts.text == "one "
    _, ts = _run([b"a#", b"#b"], ["###"])
    assert ts.matched is None and not ts.stopped


def test_finish_releases_held_text_and_incomplete_tail():
    out, ts = _run([b"ok#", b"\xe2\x82"], ["##"])
    assert out[-1] == ("#\ufffd", [0, 1], False) and ts.text == "ok#\ufffd"
