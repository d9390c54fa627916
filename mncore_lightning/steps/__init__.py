"""The compiled steps: each LightningModule hook run on the TorchDynamo capture.

`hooks.CapturedHook` (training with automatic optimization, evaluation and predict),
`manual` and `manual_host` (manual optimization: one device call, or host-driven),
`groups` (steps_per_call), `update` (what a training step runs after its forward),
`logs` and `update_logs` (self.log recorded in the step and replayed into Lightning)."""
