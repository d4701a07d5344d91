"""The drafter network: exactly the code a Hub folder carries (`DCOCOConfig`, `DCOCODraftModel`, the correctors).

Every module here imports only its neighbours, so `save_pretrained` copies them flat into a folder and
`AutoModel.from_pretrained(folder, trust_remote_code=True)` builds the network from them.
"""
