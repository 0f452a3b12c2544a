"""The `torchkvops` command line (`python -m torchkvops`, or the `torchkvops` console script).

  main       the parser, built from COMMANDS, and the entry point: main(argv) -> exit code
  rollout, bench, bench_op, bench_train, bench_turns
             one module a command, each owning its parser, checks and run (NAME, HELP, DESCRIPTION,
             EPILOG, add_arguments, check_args, execute)
  arguments  the arguments more than one command takes, and the names they choose from
  checks     the argument types and every check made before any work (CLIError: exit code 2)
  launch     alone or under torchrun: the process group, the device, the shards
  model      the dtype, the config, the model and tokenizer

A new command: a module here with those seven names, added to main.COMMANDS.
The commands call the library's public API and the benchmark harness (torchkvops.bench); neither
imports anything from here. Importing this package loads neither torch nor transformers.
"""
