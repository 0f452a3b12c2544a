"""The `torchkvops` command line (`python -m torchkvops`, or the `torchkvops` console script).

  main      the parser and the entry point: main(argv) -> exit code
  checks    the argument types and every check made before any work (CLIError: exit code 2)
  launch    alone or under torchrun: the process group, the device, the shards
  model     the dtype, the config, the model and tokenizer
  rollout   the `rollout` command        bench  the `bench` command        bench_op  the `bench-op` command

A new command: a module here with its cmd_*(args) function, and its subparser and checks in main.py.
The commands call the library's public API and the benchmark harness (torchkvops.bench); neither
imports anything from here. Importing this package loads neither torch nor transformers.
"""
