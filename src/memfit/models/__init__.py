"""Built-in models: a GPT (:mod:`memfit.models.gpt`) and a LLaMA (:mod:`memfit.models.llama`).

They are the demo's and the tests' own models, built from small config dataclasses; users
bring theirs (Hugging Face, torchvision, timm, PEFT-wrapped) and memfit treats them alike.
"""
