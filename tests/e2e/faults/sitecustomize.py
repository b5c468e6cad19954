"""Fault injection for the end-to-end tests, loaded by a server subprocess whose PYTHONPATH
starts with this directory and whose environment sets ``ATOM_TEST_FAIL_OUTPUT=MARKER``:
processing the output of a request whose prompt contains MARKER raises once the request
has 3 tokens, as a detokenizer or stop-string bug would. Nothing else changes."""

import os

_marker = os.environ.get("ATOM_TEST_FAIL_OUTPUT")
if _marker:
    from atom.engine import output_processor

    _update = output_processor.RequestState.update

    def update(self, out, want_output=True):
        if self.prompt and _marker in self.prompt and len(self.token_ids) + len(out.new_token_ids) >= 3:
            raise RuntimeError("injected output-processing failure")
        return _update(self, out, want_output)

    output_processor.RequestState.update = update
