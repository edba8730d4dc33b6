"""gpufeed.bench.trace: the GPU's work in a profiler trace summed up per stream and compared kernel by kernel, and
the timed loop's trace recorded by torch's profiler (on this CPU machine, of the CPU)."""

from __future__ import annotations

import json

import pytest

from gpufeed.bench import trace, train


def _kernel(name, stream, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": 0, "stream": stream}}


def _write(path, events, steps):
    # The shape torch's profiler writes, with CPU-side events beside the GPU's (not counted).
    data = {"schemaVersion": 1, "traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::conv2d", "pid": 1,
                                                 "tid": 1, "ts": 0, "dur": 5000}, *events],
            "gpufeed": {"what": "x", "steps": steps}}
    path.write_text(json.dumps(data))
    return str(path)


def test_summary_per_stream_idle_and_overlap(tmp_path):
    # Two steps on the model's stream 7 (conv 3 ms + gemm 1 ms each, 1 ms idle between the steps), a decoder's
    # stream 20 with a kernel beside the second conv and a copy after it.
    events = [_kernel("conv", 7, 0, 3000), _kernel("gemm", 7, 3000, 1000),
              _kernel("conv", 7, 5000, 3000), _kernel("gemm", 7, 8000, 1000),
              _kernel("roi_align", 20, 6000, 500), _kernel("Memcpy HtoD", 20, 8500, 1000, cat="gpu_memcpy")]
    t = trace.load(_write(tmp_path / "a.json", events, steps=2))
    assert t.main == 7 and t.steps == 2 and t.span_us == 9500
    assert t.streams[7].kernels == {"conv": (6000, 2), "gemm": (2000, 2)}
    assert t.streams[20].busy_us == {"kernel": 500, "copy": 1000}
    text = "\n".join(trace.summary(t))
    assert "4.75 ms of GPU time line per step" in text
    assert "stream 7 (model): kernel 4.00 ms" in text and "conv 3.00 ms x2" not in text and "conv 3.00 ms x1" in text
    assert "stream 20: copy 0.50 ms, kernel 0.25 ms" in text
    # idle: 9.5 - 8 = 1.5 ms over 2 steps, 0.5 of it beside the copy (which outlasts the model's last kernel), 1.0
    # with nothing running (between the steps); beside its kernels: 0.5 (roi_align) + 0.5 (the copy's first half).
    assert ("idle 0.75 ms per step (16% of the line): 0.25 ms while other streams ran, 0.50 ms with nothing on the "
            "GPU running") in text
    assert "beside its kernels 0.50 ms per step" in text
    # Streams with under 1% of the model's kernel time are summed in one line.
    tiny = [_kernel("rgba2rgb", 100 + k, 100 * k, 10) for k in range(3)]
    text = "\n".join(trace.summary(trace.load(_write(tmp_path / "b.json", events + tiny, steps=2))))
    assert "stream 100" not in text and "  3 more streams: kernel 0.01 ms" in text


def test_compare_names_the_kernels_that_slowed(tmp_path):
    alone = trace.load(_write(tmp_path / "alone.json", [_kernel("conv", 7, 0, 3000), _kernel("gemm", 7, 3000, 1000)],
                              steps=1))
    fed = trace.load(_write(tmp_path / "fed.json", [_kernel("conv", 7, 0, 3600), _kernel("gemm", 7, 4000, 1000),
                                                    _kernel("decode", 9, 0, 200)], steps=1))
    lines = trace.compare(alone, fed)
    assert lines[0].startswith("the model's stream, per step: kernels 4.00 ms alone, 4.60 ms fed; idle while "
                               "other streams ran 0.00 ms alone, 0.00 ms fed; idle with nothing on the GPU running "
                               "0.00 ms alone, 0.40 ms fed")
    assert lines[1] == "  conv: 3.00 -> 3.60 ms (+0.60)"


def test_ranks_say_which_came_last_to_the_all_reduce_each_step(tmp_path, capsys):
    """One run's ranks: per step each rank's all-reduce time (two buckets a step here), the rank with the least
    came last and the others waited the difference; traces without all-reduce kernels are named."""
    def rank(r, per_step):
        events = [_kernel("conv", 7, 10_000 * k, 3000) for k in range(len(per_step))]
        for k, (a, b) in enumerate(per_step):
            events += [_kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 19, 10_000 * k + 3000, a),
                       _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 19, 10_000 * k + 6000, b)]
        path = tmp_path / f"r{r}.json"
        data = {"traceEvents": events, "gpufeed": {"rank": r, "ranks": 2, "steps": len(per_step)}}
        path.write_text(json.dumps(data))
        return str(path)

    r0, r1 = rank(0, [(400, 600), (2500, 2500)]), rank(1, [(3000, 2000), (500, 500)])
    assert trace.main(["--ranks", r1, r0]) == 0  # any order: by the ranks the traces name
    out = capsys.readouterr().out
    assert "2 ranks, 2 steps: all-reduce ms per step by rank (rank 0 / rank 1)" in out
    assert "  step 1: 1.0 / 5.0 ms: rank 0 last, the others waited 4.0-4.0 ms" in out
    assert "  step 2: 5.0 / 1.0 ms: rank 1 last, the others waited 4.0-4.0 ms" in out
    assert "came last: rank 0 1x, rank 1 1x; the others waited 4.0 ms a step on average" in out
    plain = _write(tmp_path / "plain.json", [_kernel("conv", 7, 0, 3000)], steps=1)
    assert trace.ranks([trace.load(plain), trace.load(r0)])[0].startswith("plain.json: no all-reduce kernels")


def test_cli_on_unreadable_trace_names_it(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="bad.json: not a readable Chrome trace"):
        trace.main([str(bad)])


def test_timed_loop_records_a_trace_after_its_window(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    w = torch.randn(64, 64)
    taken = []

    def step(x, _y):
        taken.append(1)
        (x @ w).sum()

    batches = iter(lambda: (torch.randn(8, 64), None), 1)
    path = str(tmp_path / "t.json")
    run = train.timed_loop(batches, step, lambda: None, 8, steps=3, warmup=1, trace=(path, 2, {"what": "cpu"}))
    assert run.steps == 3 and len(taken) == 1 + 3 + 2  # the traced steps follow the timed window
    with open(path) as f:
        data = json.load(f)
    assert data["gpufeed"] == {"what": "cpu", "steps": 2}
    assert any(ev.get("name") == "aten::matmul" for ev in data["traceEvents"])
    assert trace.main([path]) == 0
    assert "no GPU work recorded" in capsys.readouterr().out
    # A name taken (an earlier trace, or anyone's file) is never written over: the next trace goes beside it.
    again = train.timed_loop(batches, step, lambda: None, 8, steps=1, warmup=0, trace=(path, 1, {"what": "cpu"}))
    assert again.steps == 1 and json.load(open(path))["gpufeed"]["steps"] == 2
    assert json.load(open(str(tmp_path / "t-2.json")))["gpufeed"]["steps"] == 1
    mine = tmp_path / "mine.json"
    mine.write_text("a user's own file")
    train.timed_loop(batches, step, lambda: None, 8, steps=1, warmup=0, trace=(str(mine), 1, {}))
    assert mine.read_text() == "a user's own file" and (tmp_path / "mine-2.json").exists()
