"""LoRA's pieces below the model: the adapter of one linear and the adapted weight
(``adapter``), and which linears a target list selects (``names``). ``model.lora`` applies them
to a built model."""
