"""The steps ``gpufeed bench train`` times: an emulated accelerator (a sleep of a measured step's compute time,
:mod:`gpufeed.bench.accelerator`), torchvision ResNet-50 and the CIFAR ResNet-18 on CUDA (:class:`CudaResNet`),
the Penn Treebank LSTM (:class:`CudaLstm`), and the synthetic batches already in accelerator memory that give
each step's compute time. torch and torchvision are imported only when a model is made.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator


from gpufeed.errors import ConfigError

#: Models for 32x32 images (CIFAR): ResNet-18 with a 3x3 stride-1 stem and no max-pool, 10 classes, as the
#: CIFAR ResNet papers and their reference implementations build it; trained with augment="cifar".
CIFAR_MODELS = ("cifar-resnet18",)
#: Language models for Penn Treebank windows: Zaremba et al.'s "medium" LSTM (2 layers of 650 units, dropout
#: 0.5, unrolled 35 steps, batch 20), fed with augment="tokens".
PTB_MODELS = ("ptb-lstm",)
PTB_HIDDEN = 650
PTB_LAYERS = 2

class EmulatedAccelerator:
    """The step is a sleep of the profile's compute time for this batch size (DLIO / MLPerf Storage)."""

    kind = "emulated"
    classes = 1000

    def __init__(self, profile_name: str, task: str, batch: int):
        from gpufeed.bench.accelerator import get_profile

        self.profile = get_profile(profile_name)
        self.step_s = self.profile.task(task).step_time(batch)
        self.name = self.profile.name
        self.device = None

    def step(self, x, y) -> None:
        time.sleep(self.step_s)

    def synchronize(self) -> None:
        pass

    def describe(self) -> dict:
        return {"accelerator": self.name, "accelerator_mode": "emulated", "device": self.profile.device,
                "accelerator_source": self.profile.source, "emulated_step_s": self.step_s}


class CudaResNet:
    """torchvision ResNet-50 on the current CUDA device, bf16 autocast, channels_last.

    ``step`` takes an NHWC uint8 batch already on the GPU: permuting it to NCHW gives channels_last strides
    for free, and normalisation runs on the GPU, as every real pipeline fed by DataLoader or DALI does.
    Training is forward + cross-entropy + backward + SGD step; inference is a forward under inference_mode.
    """

    kind = "cuda"

    def __init__(self, task: str, model: str = "resnet50", seed: int = 0, graph: bool = False):
        import torch
        import torchvision

        from gpufeed.pipelines.batches_gpu import resolve_device

        if graph and task != "infer":
            raise ConfigError("--cuda-graph captures the inference step; training runs eagerly (drop --cuda-graph "
                              "or use --task infer)")
        self.graph, self._captured = graph, None

        torch.manual_seed(seed)
        torch.backends.cudnn.benchmark = True
        self.torch, self.task = torch, task
        self.device = resolve_device("cuda")
        self.name = torch.cuda.get_device_name(self.device)
        self.model_name = model
        if model in CIFAR_MODELS:
            net = torchvision.models.resnet18(weights=None, num_classes=10)
            net.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
            net.maxpool = torch.nn.Identity()
            self.classes = 10
        else:
            net = getattr(torchvision.models, model)(weights=None)
            self.classes = 1000
        self.model = net.to(self.device, memory_format=torch.channels_last)
        if task == "train":
            self.model.train()
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
            self.loss = torch.nn.CrossEntropyLoss()
        else:
            self.model.eval()

    def normalise(self, x_nhwc_u8):
        from gpufeed.pipelines.loader import normalise

        return normalise(x_nhwc_u8)

    def step(self, x, y) -> None:
        torch = self.torch
        if self.graph:
            self._replay(x)
            return
        x = self.normalise(x)
        if self.task == "train":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = self.loss(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
                self.model(x)

    def _replay(self, x) -> None:
        """Inference as one CUDA graph: the uint8 batch is copied into the graph's input, and normalisation and
        the whole forward pass go to the GPU as one launch, as inference servers run a model (TensorRT,
        torch.compile's "reduce-overhead"); the loop's thread then spends microseconds per batch instead of a
        launch per layer. Captured on the first batch of each shape, after warm-up passes on a side stream
        (cuDNN picks its kernels there; nothing may copy from the host while a graph is captured)."""
        torch = self.torch
        if self._captured is None or self._captured[0].shape != x.shape:
            from gpufeed.pipelines.loader import imagenet_stats, normalise

            stats = imagenet_stats(self.device)

            def forward(batch):
                return self.model(normalise(batch, stats))

            static = x.clone()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), torch.inference_mode(), \
                    torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                for _ in range(3):
                    forward(static)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.inference_mode(), \
                    torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                out = forward(static)
            self._captured = (static, graph, out, stats)
        static, graph = self._captured[:2]
        static.copy_(x)
        graph.replay()

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def describe(self) -> dict:
        torch = self.torch
        return {"accelerator": self.name, "accelerator_mode": "measured", "device": self.name,
                "model": self.model_name, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                **({"cuda_graph": True} if self.graph else {})}


class CudaLstm:
    """A word-level LSTM language model on the current CUDA device (:data:`PTB_MODELS`): embedding, 2 LSTM
    layers of 650 units (cuDNN), dropout 0.5, a linear decoder over the vocabulary. Training is forward +
    cross-entropy over every position + backward + gradient clipping (0.25) + SGD; inference a forward under
    inference_mode. Each batch of windows starts from a zero hidden state (windows are shuffled samples).
    float32, as the published PTB models train."""

    kind = "cuda"

    def __init__(self, task: str, vocab: int, model: str = PTB_MODELS[0], seed: int = 0, device: str = "cuda"):
        import torch

        from gpufeed.pipelines.batches_gpu import resolve_device

        torch.manual_seed(seed)
        self.torch, self.task, self.model_name, self.classes = torch, task, model, vocab
        self.device = resolve_device(device)
        self.name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        nn = torch.nn

        class _LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(vocab, PTB_HIDDEN)
                self.drop = nn.Dropout(0.5)
                self.lstm = nn.LSTM(PTB_HIDDEN, PTB_HIDDEN, PTB_LAYERS, dropout=0.5, batch_first=True)
                self.decoder = nn.Linear(PTB_HIDDEN, vocab)

            def forward(self, ids):
                out, _ = self.lstm(self.drop(self.embed(ids)))
                return self.decoder(self.drop(out))

        self.model = _LM().to(self.device)
        if task == "train":
            self.model.train()
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1.0)
            self.loss = nn.CrossEntropyLoss()
        else:
            self.model.eval()

    def step(self, x, y) -> None:
        torch = self.torch
        if self.task == "train":
            logits = self.model(x)
            loss = self.loss(logits.reshape(-1, self.classes), y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.25)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            with torch.inference_mode():
                self.model(x)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def describe(self) -> dict:
        torch = self.torch
        return {"accelerator": self.name, "accelerator_mode": "measured", "device": self.name,
                "model": self.model_name, "vocab": self.classes, "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version()}


def make_accelerator(kind: str, task: str, batch: int, profile: str, model: str, seed: int, vocab: int | None = None,
                     device: str = "cuda", graph: bool = False):
    """``device``: the language model also runs on the CPU (the distributed path's tests use it); ``graph``:
    a CUDA image model's inference step as one CUDA graph."""
    if kind == "emulated":
        return EmulatedAccelerator(profile, task, batch)
    if model in PTB_MODELS:
        return CudaLstm(task, vocab, model=model, seed=seed, device=device)
    return CudaResNet(task, model=model, seed=seed, graph=graph)


def resolve_accelerator(choice: str, emulable: bool = True) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU and torchvision is installed, else ``emulated``
    (``emulable``: whether the model has an emulated profile to suggest instead)."""
    if choice == "emulated":
        return "emulated"
    try:
        import torch
    except ImportError:
        torch = None
    has_gpu = torch is not None and torch.cuda.is_available()
    try:
        import torchvision  # noqa: F401
        has_vision = True
    except ImportError:
        has_vision = False
    if choice == "cuda" and not (has_gpu and has_vision):
        why = "torch sees no CUDA GPU" if not has_gpu else "torchvision is not installed"
        raise ConfigError(f"--accelerator cuda: {why}; install gpufeed[gpu] on a GPU machine"
                          + (", or use --accelerator emulated --profile h200" if emulable else ""))
    return "cuda" if has_gpu and has_vision else "emulated"


def synthetic_batches(accel, batch: int, size: int, seed: int, seq_len: int | None = None) -> Iterator:
    """The same batch forever, already on the accelerator: the loop's no-data-wait baseline (NHWC uint8
    images, or ``seq_len`` token ids in and out for a language model)."""
    if accel.kind == "emulated":
        return itertools.repeat((None, None))
    torch = accel.torch
    gen = torch.Generator(device=accel.device).manual_seed(seed)
    if seq_len is not None:
        ids = torch.randint(0, accel.classes, (batch, seq_len + 1), dtype=torch.int64, device=accel.device,
                            generator=gen)
        return itertools.repeat((ids[:, :-1], ids[:, 1:]))
    x = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, device=accel.device, generator=gen)
    y = torch.randint(0, accel.classes, (batch,), dtype=torch.int64, device=accel.device, generator=gen)
    return itertools.repeat((x, y))
