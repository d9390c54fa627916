"""`mlsdk.experimental` on the emulated device (see `mlsdk`)."""
