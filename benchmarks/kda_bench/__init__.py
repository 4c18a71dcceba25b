"""KDA prefill benchmark package: cula's fused SM90 kernel side by side with its baselines.

``benchmarks/bench_kda_prefill.py`` is the entry point; the modules, by role:

* :mod:`kda_bench.suite`: the configurations (shapes, varlen lengths, named suites);
* :mod:`kda_bench.inputs`: options and random inputs (beta drawn once as logits);
* :mod:`kda_bench.floors`: the HBM and tensor-core floors (bytes, flops, measured rates);
* :mod:`kda_bench.timing`: CUDA-event medians of eager calls and CUDA-graph replays;
* :mod:`kda_bench.reference`: the fp32 recurrence on a stated slice, relative errors;
* :mod:`kda_bench.baselines`: one file per kernel behind one interface (cula, FLA, FlashKDA);
* :mod:`kda_bench.runner`: one configuration on the GPU, the GPU suite, the CPU check;
* :mod:`kda_bench.report` / :mod:`kda_bench.plot`: JSON, Markdown, merge, PNG;
* :mod:`kda_bench.env`: device, versions and commit for the reports;
* :mod:`kda_bench.cli`: the command line.
"""
