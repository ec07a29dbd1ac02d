"""OpenAI's Responses API (POST /v1/responses; GET and DELETE /v1/responses/{id}; GET
/v1/responses/{id}/input_items), served on the chat pipeline:

    protocol.py   the request, parsed strictly (every field of OpenAI's schema accepted)
    input_items.py  its `input`: messages, function calls and outputs, reasoning items
    to_chat.py    request + stored conversation -> the chat request; chat's errors renamed
    serving.py    create (whole or streamed), the stored responses' routes
    output.py     a whole chat answer -> output items (reasoning, message, function_call)
    events.py     chat chunks -> the documented stream events
    objects.py    the Response, its items and the events' shapes (OpenAI's field names)
    store.py      the bounded, expiring in-memory store behind store / previous_response_id
"""
