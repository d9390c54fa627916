"""Data parallel on MN-Core: MNCoreDDPStrategy (one process per device) and the SyncBatchNorm
traced with functional collectives."""
