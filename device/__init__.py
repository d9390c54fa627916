"""`device/` is the source root of the device layer, not a package: `import mncore_device`.

The package itself is `device/mncore_device/` (as `src/` holds a package elsewhere). This file
only stops `import device` from loading a second, unrelated copy of the layer.
"""

raise ImportError(
    "'device' is the source folder of the MN-Core device layer, not a package: "
    "import mncore_device instead"
)
