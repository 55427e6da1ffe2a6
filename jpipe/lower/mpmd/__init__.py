"""The per-rank lowering (``lowering="mpmd"``): each rank runs its own programs.

- `jpipe.lower.mpmd.programs`: the op order of each rank, one compiled program
  per piece (`RankPrograms`), its memory account, and `MpmdLowering`;
- `jpipe.lower.mpmd.transfer`: moving values between ranks, in one process or
  across processes;
- `jpipe.lower.mpmd.bytes`: what each device holds: its own rank's terms.
"""
