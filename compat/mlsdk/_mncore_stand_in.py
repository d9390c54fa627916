"""Marks this `mlsdk` package as mncore-lightning's stand-in for PFN's MLSDK.

`mncore_device.device.is_stand_in` looks for this file: a package holding it is never taken
for the real MLSDK (so "mncore2:*" devices still say MLSDK is not installed).
"""
