"""Devices and processes: what every run needs around the compiler.

- `jpipe.runtime.devices`: fake CPU devices and a description of the devices;
- `jpipe.runtime.distributed`: joining processes with `jax.distributed`,
  failing fast and saying which process is missing;
- `jpipe.runtime.launch`: N local processes (``python -m jpipe.launch``);
- `jpipe.runtime.console`: what every command line does around its ``main``;
- `jpipe.runtime.jsonfile`: reading a user's JSON file, with errors that
  name the file, the place and the kind of file expected.
"""
