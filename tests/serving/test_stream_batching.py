"""A request's tokens reach its HTTP thread in mailboxes (mlx_lm_diffusion.serving.stream_batching)
and the clients of a batch's rows are polled at once (mlx_lm_diffusion.serving.peers)."""

import socket
import threading
from queue import Queue

from mlx_lm.generate import TextStateMachine
from mlx_lm.server import Response

from mlx_lm_diffusion.serving import peers
from mlx_lm_diffusion.serving.stream_batching import Mailbox, ResponseSender, merge_texts, unpack


def responses(texts, last_finish=None):
    out = [Response(t, i, -0.5 * i, None, ()) for i, t in enumerate(texts)]
    if last_finish is not None:
        out[-1].finish_reason = last_finish
    return out


def test_a_slow_reader_gets_every_token_since_its_last_read_in_one_item():
    q = Queue()
    sender = ResponseSender(q)
    sender.send(responses(["a", "b"]))
    sender.send(responses(["c"]))  # (the reader has not come: the same mailbox)
    sender.put(("draft", 1))  # a draft comes after the tokens before it ...
    sender.send(responses(["d"]))  # ... and before the tokens after it
    sender.put(None)
    items = [q.get() for _ in range(q.qsize())]
    assert [type(i) for i in items] == [Mailbox, tuple, Mailbox, type(None)]
    assert [r.text for r in items[0].take()] == ["a", "b", "c"]
    sender.send(responses(["e"]))  # (taken: a new mailbox)
    assert [r.text for r in q.get().take()] == ["e"]


def test_tokens_sent_while_the_reader_takes_are_never_lost():
    q, sent = Queue(), 2000
    sender = ResponseSender(q)

    def produce():
        for i in range(sent):
            sender.send([Response(str(i % 10), i, 0.0, None, ())])
        sender.put(None)

    thread = threading.Thread(target=produce)
    thread.start()
    got = []
    for _ in range(sent + 1):  # (bounded: at most one item per token, and the end)
        item = q.get(timeout=10)
        if item is None:
            break
        got += item.take()
    thread.join()
    assert [r.token for r in got] == list(range(sent))


def test_merged_texts_read_the_same_through_the_handlers_state_machine():
    """One chunk's text for a run, every token still counted, the text the client reads
    unchanged (a control sequence split across tokens included), a finishing "stop"
    Response's text left where mlx_lm's handler drops it."""
    sm = TextStateMachine({"normal": [("<think>", "reasoning")], "reasoning": [("</think>", "normal")]})

    def read(items):
        state, out = sm.make_state("normal"), []
        for r in items:
            if r.finish_reason == "stop":
                state, _ = TextStateMachine.discard(state)
                continue
            state, segments = TextStateMachine.split(state, r.text)
            if r.finish_reason == "length":
                state, flushed, current = TextStateMachine.flush(state)
                segments.append((current, flushed))
            for kind, text in segments:  # (runs of one state joined: how they were split does not matter)
                if text and out and out[-1][0] == kind:
                    out[-1] = (kind, out[-1][1] + text)
                elif text:
                    out.append((kind, text))
        return out

    for finish in (None, "length", "stop"):
        run = responses(["Hi <th", "ink>so", "me</thi", "nk> ok", "!"], finish)
        merged = merge_texts(run)
        assert [r.token for r in merged] == [r.token for r in run]
        assert [r.logprob for r in merged] == [r.logprob for r in run]
        assert [r.finish_reason for r in merged] == [r.finish_reason for r in run]
        assert sum(bool(r.text) for r in merged) == 1 + (finish == "stop")
        assert read(merged) == read(run) and read(run)[1] == ("reasoning", "some")
    assert merge_texts(responses(["x"])) == responses(["x"])
    q = Queue()
    sender = ResponseSender(q)
    sender.send(responses(["a", "b"]))
    assert [r.text for r in unpack([q.get(), "other"]) if not isinstance(r, str)] == ["ab", ""]


def test_peers_closed_polls_every_socket_at_once():
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        pairs[1][1].close()  # that client left
        pairs[2][1].sendall(b"x")  # that one sent more (not the end of its stream)
        assert peers.closed([a for a, _ in pairs] + [None]) == [False, True, False, None]
        assert peers.closed([]) == []
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_a_half_close_is_told_from_a_close_by_what_a_write_brings_back():
    """The end of a client's stream (FIN) is HALF: it may still read. One that closed
    entirely answers the next write with a reset: then it is gone (True)."""
    import time

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    halves, fulls = socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port))
    half, full = listener.accept()[0], listener.accept()[0]
    try:
        halves.shutdown(socket.SHUT_WR)
        fulls.close()
        time.sleep(0.1)
        assert peers.closed([half, full]) == [peers.HALF, peers.HALF]
        for server_side in (half, full):
            server_side.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        time.sleep(0.1)
        assert peers.closed([half, full]) == [peers.HALF, True]
        assert halves.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"  # (the half-closed client reads on)
    finally:
        for s in (listener, halves, half, full):
            s.close()
