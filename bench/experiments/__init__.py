"""The project's own performance experiments, apart from the user-facing ``gpufeed bench``: node-scale conversion
against its limit loop (``convert_node``, ``convert_scaling``, ``scale``), decode rates and contention on the GPU
machine (``decode_rates``, ``decode_contention``), per-transform and per-format costs (``transform_speed``,
``formats_speed``). Each runs as ``python -m gpufeed.bench.experiments.NAME``; scripts/ drives them on the
device machines and results/ keeps what they measured."""


def dataset_parser(module: str, doc: str | None):
    """The command line of an experiment run on a benchmark dataset, ``python -m MODULE DST ...``: described by the
    first paragraph of the module's docstring ``doc``, with the dataset argument; the caller adds its options."""
    import argparse

    p = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or "").split("\n\n")[0])
    p.add_argument("dst", help="benchmark dataset (gpufeed bench dataset DST)")
    return p
