"""``python -m gpufeed.bench.experiments.decode_contention DST``: the ``hw`` path's evaluation step beside ResNet-50
inference on one GPU, to tell what limits feeding the model from the JPEG engines.

In one process, on in-memory batches of the dataset's RecordIO (no disk, no DataLoader workers), each mode for
``--seconds``:

* ``model``: ResNet-50 inference (bf16, channels_last, as ``gpufeed bench train``) on one synthetic batch, back
  to back: the model's own rate (measured first and last, to bracket the GPU's drift);
* ``decode``: the hw evaluation step alone (engines, centre crop, resize to 224), with ``--threads`` decoder
  threads as :func:`gpufeed.pipelines.batches_gpu.decoded_batches` runs them in the loader;
* ``pipeline``: the model fed by that step as in the loader's loop (the model's stream waits for each batch
  on the GPU); its rate over the model's own is the AU the GPU side allows, DataLoader aside;
* ``beside``: both at once without a dependency (the model in this thread, the step consumed in another on
  its own stream): what each does to the other's rate.

Each under the variants in ``--variants``: ``base`` (the loader's defaults), ``priority`` (the decoders'
streams at the GPU's highest priority), ``barrier`` (each decode call waits on the host for its stream's earlier
work), ``switch`` (the interpreter's thread switch interval at 0.2 ms instead of 5: a thread that gives up the
GIL around each image's C++ call waits less to take it back), ``graph`` (the model run as one CUDA graph, so
this thread launches once per batch instead of once per layer), ``sidestream`` (the model on a stream of its own
instead of CUDA's legacy default stream, which every blocking stream and every legacy-stream operation waits
for), ``prealloc`` (the engines' working memory allocated up front for a batch of 1600x1600 images), ``pool`` (nvImageCodec's image pool kept across batches, and no cross-stream reuse through GPU-side
waits; it stays set for later variants, so it runs last). Per row: the rates, each decoder stage's host
milliseconds per batch, and how many of the pipeline's images differ from the same images decoded alone
(nvJPEG's hardware path writes at the call, not in stream order: a pipeline that reuses memory too early shows
it here).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time

VARIANTS = ("base", "priority", "barrier", "switch", "graph", "sidestream", "prealloc", "pool")
#: The ``prealloc`` variant's nvImageCodec options: the engines' working memory sized up front for a batch of the
#: largest images of the benchmark dataset (nvImageCodec's default sizes it for one 1x1 image).
PREALLOC = ("nvjpeg_hw_decoder:preallocate_width_hint=1600 nvjpeg_hw_decoder:preallocate_height_hint=1600 "
            "nvjpeg_hw_decoder:preallocate_batch_size={batch}")
#: The interpreter's thread switch interval under the ``switch`` variant (Python's default is 5 ms).
SWITCH_S = 0.0002


class Bench:
    def __init__(self, args):
        import torch

        from gpufeed.bench.experiments.decode_rates import _Record, _records
        from gpufeed.bench.train_models import CudaResNet
        from gpufeed.pipelines.batches_cpu import EncodedBytes, collate_encoded

        self.torch, self.args = torch, args
        datas = _records(args.dst, args.images)
        encoded = [EncodedBytes(train=False)(_Record(d, i)) for i, d in enumerate(datas)]
        b = args.batch
        self.steps = [collate_encoded(encoded[k:k + b]) for k in range(0, len(encoded) - b + 1, b)]
        if not self.steps:
            raise SystemExit(f"{args.dst}: fewer than one batch of {b} records")
        self.mean_kib = sum(map(len, datas)) / len(datas) / 1024
        self.model = CudaResNet("infer")
        self.device = self.model.device
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.x = torch.randint(0, 256, (b, 224, 224, 3), dtype=torch.uint8, device=self.device, generator=gen)
        self.y = torch.zeros(b, dtype=torch.int64, device=self.device)
        self.reference = None
        self.eager = self.model
        self.rows = []

    def graph(self) -> None:
        """The model as one CUDA graph from here on (:class:`CudaResNet`'s ``--cuda-graph``), its own rate a row."""
        from gpufeed.bench.train_models import CudaResNet

        self.eager = self.model
        self.model = CudaResNet("infer", graph=True)
        self.model_alone("graph")

    # ------------------------------------------------------------------------------------------- pieces
    def decoders(self, variant: str) -> list:
        from gpufeed.pipelines.batches_gpu import HwJpegDecoder

        options = PREALLOC.format(batch=self.args.batch) if variant == "prealloc" else ""
        made = [HwJpegDecoder(self.device, train=False, priority=-3 if variant == "priority" else 0, options=options)
                for _ in range(self.args.threads)]
        for d in made:
            d.barrier = variant == "barrier"
            d.decoded(*(self.steps[0][i] for i in (0, 1, 3, 4)))  # nvImageCodec's buffers set up
            d.stage_s.clear()
        self.torch.cuda.synchronize()
        return made

    def batches(self, seconds: float):
        """The in-memory batches in a cycle until ``seconds`` have passed."""
        deadline = time.perf_counter() + seconds
        for k in itertools.count():
            if time.perf_counter() >= deadline:
                return
            yield self.steps[k % len(self.steps)]

    def decoded(self, decoders, seconds: float):
        from gpufeed.pipelines.batches_gpu import decoded_batches

        return decoded_batches(self.batches(seconds), decoders, self.device)

    def mismatches(self, x, k: int, count) -> None:
        """Images of batch ``k`` (in cycle order) that differ from the same batch decoded alone, added up on
        the GPU (no host sync)."""
        if self.reference is not None:
            ref = self.reference[k % len(self.reference)]
            count += (x != ref).flatten(1).any(1).sum()

    def row(self, mode: str, variant: str, **figures) -> None:
        r = {"bench": "decode-contention", "mode": mode, "variant": variant, "batch": self.args.batch,
             "threads": self.args.threads, "mean_kib": round(self.mean_kib, 1),
             "gpu": self.torch.cuda.get_device_name(self.device), **figures}
        self.rows.append(r)
        print(json.dumps(r), flush=True)

    @staticmethod
    def stages(decoders, batches: int) -> dict:
        total: dict[str, float] = {}
        for d in decoders:
            for k, v in d.stage_s.items():
                total[k] = total.get(k, 0.0) + v
        return {k: round(v * 1e3 / max(1, batches), 2) for k, v in sorted(total.items())}

    # ------------------------------------------------------------------------------------------- modes
    def run(self, mode: str, variant: str, model_rate: float) -> None:
        if mode == "decode":
            self.decode_alone(variant)
        elif mode == "pipeline":
            self.pipeline(variant, model_rate)
        elif mode == "beside":
            self.beside(variant, model_rate)
        else:
            raise SystemExit(f"--modes: unknown {mode!r}; choose from decode, pipeline, beside")

    def model_alone(self, label: str) -> float:
        torch, b = self.torch, self.args.batch
        for _ in range(3):
            self.model.step(self.x, self.y)
        torch.cuda.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < self.args.seconds:
            self.model.step(self.x, self.y)
            n += 1
        torch.cuda.synchronize()
        rate = n * b / (time.perf_counter() - t0)
        self.row("model", label, model_images_per_s=round(rate, 1))
        return rate

    def decode_alone(self, variant: str) -> None:
        torch, b = self.torch, self.args.batch
        decoders = self.decoders(variant)
        keep = self.reference is None
        kept, count = [], torch.zeros((), dtype=torch.int64, device=self.device)
        n, t0 = 0, time.perf_counter()
        for x, _y in self.decoded(decoders, self.args.seconds):
            if keep and n < len(self.steps):
                kept.append(x.clone())
            else:
                self.mismatches(x, n, count)
            n += 1
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if keep:
            self.reference = kept
        self.row("decode", variant, images_per_s=round(n * b / seconds, 1), batches=n,
                 stage_ms_per_batch=self.stages(decoders, n), mismatched_images=int(count))

    def pipeline(self, variant: str, model_rate: float) -> None:
        torch, b = self.torch, self.args.batch
        decoders = self.decoders(variant)
        count = torch.zeros((), dtype=torch.int64, device=self.device)
        n, t0 = 0, time.perf_counter()
        for x, y in self.decoded(decoders, self.args.seconds):
            self.model.step(x, y)
            self.mismatches(x, n, count)
            n += 1
        torch.cuda.synchronize()
        rate = n * b / (time.perf_counter() - t0)
        self.row("pipeline", variant, images_per_s=round(rate, 1), au=round(rate / model_rate, 3), batches=n,
                 stage_ms_per_batch=self.stages(decoders, n), mismatched_images=int(count))

    def beside(self, variant: str, model_rate: float) -> None:
        torch, b = self.torch, self.args.batch
        decoders = self.decoders(variant)
        done = {"n": 0, "seconds": 0.0}

        def consume():
            with torch.cuda.device(self.device), torch.cuda.stream(torch.cuda.Stream(self.device)):
                t0 = time.perf_counter()
                for _ in self.decoded(decoders, self.args.seconds):
                    done["n"] += 1
                torch.cuda.current_stream(self.device).synchronize()
                done["seconds"] = time.perf_counter() - t0

        thread = threading.Thread(target=consume, name="gpufeed-contention")
        steps, t0 = 0, time.perf_counter()
        thread.start()
        while thread.is_alive():
            self.model.step(self.x, self.y)
            steps += 1
        torch.cuda.synchronize()
        model_seconds = time.perf_counter() - t0
        thread.join()
        model = steps * b / model_seconds
        self.row("beside", variant, images_per_s=round(done["n"] * b / done["seconds"], 1),
                 model_images_per_s=round(model, 1), model_share=round(model / model_rate, 3),
                 batches=done["n"], stage_ms_per_batch=self.stages(decoders, done["n"]))


def main(argv=None) -> int:
    from gpufeed.bench.results import append_rows
    from gpufeed.pipelines.batches_gpu import set_image_pool

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dst", help="benchmark dataset (gpufeed bench dataset DST)")
    p.add_argument("--images", type=int, default=4096, help="records held in memory and decoded in a cycle")
    p.add_argument("--batch", type=int, default=512, help="images per batch (bench train's inference batch)")
    p.add_argument("--seconds", type=float, default=5.0, help="length of each mode's window")
    p.add_argument("--threads", type=int, default=2, help="decoder threads (the loader's decode_threads)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {','.join(VARIANTS)}, in order")
    p.add_argument("--modes", default="decode,pipeline,beside", help="some of decode,pipeline,beside")
    p.add_argument("--results", default=None, help="JSON-lines file to append the rows to")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
    modes = [m for m in args.modes.split(",") if m]
    bench = Bench(args)
    model_rate = bench.model_alone("first")
    bench.decode_alone("base")  # the reference pixels
    for variant in variants:
        if variant == "pool":
            set_image_pool(bench.device, keep_bytes=1 << 62, internal_dependencies=False)
        switch = sys.getswitchinterval()
        if variant == "switch":
            sys.setswitchinterval(SWITCH_S)
        if variant == "graph":
            bench.graph()
        side = bench.torch.cuda.Stream(bench.device) if variant == "sidestream" else None
        for mode in modes:
            if side is not None:
                side.wait_stream(bench.torch.cuda.current_stream(bench.device))
            with bench.torch.cuda.stream(side):  # None: the current stream
                bench.run(mode, variant, model_rate)
        sys.setswitchinterval(switch)
        if variant == "graph":
            bench.model = bench.eager
    bench.model_alone("last")
    append_rows(args.results, bench.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
