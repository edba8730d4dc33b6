"""The project's own performance experiments, apart from the user-facing ``gpufeed bench``: node-scale conversion
against its limit loop (``convert_node``, ``convert_scaling``, ``scale``), decode rates and contention on the GPU
machine (``decode_rates``, ``decode_contention``), per-transform and per-format costs (``transform_speed``,
``formats_speed``). Each runs as ``python -m gpufeed.bench.experiments.NAME``; scripts/ drives them on the
device machines and results/ keeps what they measured."""
