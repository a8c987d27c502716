"""The benchmarks and studies behind ``results/bench`` and ``results/memory``; each has a thin
command-line entry ``scripts/<name>.py`` (argument parsing and one call into its module here).

What they share:

    common               paths, options, the device, the recorded environment, interleaved timing
                         with bracketed ratios, markdown tables, the JSON + markdown outputs
    models               roberta-base and MiniLM, padded batches, the methods (patches,
                         checkpointing, compact activations), saved-bytes meters
    peak                 peak memory of training steps, each in a fresh process

One module per benchmark (its script in brackets):

    layer_step           one linear layer, forward + backward, every sketch (bench_layer)
    model_step           one training step of a whole model per method (bench_model)
    backward_overhead    the forum case timed like for like; our Function's exact path
    sketch_variance      each sketch's weight-gradient variance on real activations
    importance_variance  importance sampling's variance against the paper's sketches
    bits_cost            where the time of b-bit stored rows goes
    speed                step time of each saving against exact and exact-skip, full and real
                         rows, eager and compiled; each codec beside a copy (bench_speed)
    gelu_bits            bias and variance of the few-bit GELU codes
    equal_bytes          weight-gradient error against stored bits (and the code's group size)
    saved_tensors        what a training forward saves, by autograd node
    decoders             compact activations on decoder LMs: saved bytes by op, step time
    decoder_finetune     a small pretrained causal LM fine-tuned with and without them
    architectures        every family under every setup: saved bytes, gradient error, parts, time
    memory_table         Table 3 and Figure 3: saved bytes and peak memory of roberta-base
    readme               the generated blocks of results/bench/README.md (bench_report)

And a check of the test suite rather than of the library:

    mutants              plant one small bug at a time; the tests must catch each (mutation_check)
"""
