"""The scripted retail user: identity, order id, confirmation, multi-step intents, done."""

from __future__ import annotations

from trace_assets.envs.retail import RetailEnv
from trace_assets.envs.retail.tasks import make_task
from trace_assets.envs.retail.user import DONE, NO, YES, ScriptedUser

ENV = RetailEnv()
NOT_HANDLED = lambda intent: False  # noqa: E731
HANDLED = lambda intent: True  # noqa: E731


def task_with(family: str, id_method: str):
    return next(t for t in (make_task(family, s) for s in range(100)) if t.scenario["id_method"] == id_method)


def test_opening_states_intent_but_not_identity():
    for family in ENV.families():
        task = make_task(family, 11)
        user = ScriptedUser(task.scenario)
        opening = user.opening()
        first = task.scenario["intents"][0]
        assert first["request"] in opening
        if first.get("order_id"):
            assert first["order_id"] in opening
        assert task.scenario["email"] not in opening and task.scenario["zip"] not in opening


def test_identity_by_email():
    s = task_with("cancel_pending", "email").scenario
    user = ScriptedUser(s)
    turn = user.reply("Please provide your email, or your name and zip code.", NOT_HANDLED)
    assert (turn.text, turn.done, turn.kind) == (f"My email is {s['email']}.", False, "identity")
    turn = user.reply("Could you verify your identity?", NOT_HANDLED)
    assert turn.text == f"My email is {s['email']}."
    # Asked only for name and zip, even an email user gives them.
    turn = user.reply("What is your first name, last name and zip code?", NOT_HANDLED)
    assert turn.text == f"My name is {s['first_name']} {s['last_name']} and my zip code is {s['zip']}."


def test_identity_by_name_and_zip():
    s = task_with("cancel_pending", "name_zip").scenario
    user = ScriptedUser(s)
    name_zip = f"My name is {s['first_name']} {s['last_name']} and my zip code is {s['zip']}."
    assert user.reply("What is your email address?", NOT_HANDLED).text == "I don't remember my email. " + name_zip
    assert user.reply("Please give me your name and zip code.", NOT_HANDLED).text == name_zip
    assert s["email"] not in user.reply("Please verify your identity.", NOT_HANDLED).text


def test_identity_words_without_a_request_are_not_questions():
    s = make_task("order_status", 0).scenario
    user = ScriptedUser(s)
    turn = user.reply("Thanks, I found your account by email", NOT_HANDLED)
    assert turn.kind == "restate" and turn.text == s["intents"][0]["request"]


def test_order_id_item_options_payment_reason_address():
    exchange = make_task("exchange_delivered", 3).scenario
    intent = exchange["intents"][0]
    user = ScriptedUser(exchange)
    assert user.reply("What is the order id?", NOT_HANDLED).text == f"The order id is {intent['order_id']}."
    assert user.reply("Which item would you like to exchange?", NOT_HANDLED).text == f"The {intent['item']}."
    assert user.reply("Which color and size do you want?", NOT_HANDLED).text == f"The one with {intent['new_options']}."
    assert user.reply("Which payment method do you want the refund to?", NOT_HANDLED).text == (
        "To the original payment method, please.")
    cancel = make_task("cancel_pending", 3).scenario
    user = ScriptedUser(cancel)
    assert user.reply("May I ask the reason for cancelling?", NOT_HANDLED).text == (
        f"The reason is: {cancel['intents'][0]['reason']}.")
    modify = make_task("modify_address", 3).scenario
    address = modify["intents"][0]["address"]
    assert ScriptedUser(modify).reply("What is the new address?", NOT_HANDLED).text == (
        f"The new address is {address['address1']}, {address['city']}, {address['zip']}.")


def test_confirmation_yes_and_no():
    yes = ScriptedUser(make_task("cancel_pending", 0).scenario)
    for question in ("Do you confirm? (yes/no)", "Shall I cancel order W1234?", "Would you like me to proceed?",
                     "Do you want me to cancel it?", "Please answer yes or no.", "Can you confirm I should cancel?"):
        turn = yes.reply(question, NOT_HANDLED)
        assert (turn.text, turn.done, turn.kind) == (YES, False, "confirm_yes"), question
    no = ScriptedUser(make_task("cancel_declined", 0).scenario)
    turn = no.reply("I will cancel order W1 and refund $10.00. Do you confirm? (yes/no)", NOT_HANDLED)
    assert (turn.text, turn.done, turn.kind) == (NO, False, "confirm_no")
    # Declining handles the intent: the user is then done.
    turn = no.reply("Okay, I will not cancel it. Anything else I can help with?", NOT_HANDLED)
    assert (turn.text, turn.done) == (DONE, True)


def test_confirm_your_email_is_an_identity_question():
    s = task_with("cancel_pending", "email").scenario
    assert ScriptedUser(s).reply("Could you confirm your email?", NOT_HANDLED).kind == "identity"


def test_restates_until_handled_then_done():
    s = make_task("cancel_pending", 4).scenario
    user = ScriptedUser(s)
    turn = user.reply("Anything else I can help with?", NOT_HANDLED)
    assert (turn.text, turn.done, turn.kind) == (s["intents"][0]["request"], False, "restate")
    turn = user.reply("Your order is cancelled. Anything else I can help with?", HANDLED)
    assert (turn.text, turn.done, turn.kind) == (DONE, True, "done")
    assert user.reply("Goodbye!", HANDLED) == turn  # stays done


def test_multi_step_states_second_intent_after_first_is_handled():
    for family in ("update_address_everywhere", "cancel_and_return"):
        s = make_task(family, 5).scenario
        first, second = s["intents"]
        handled: set[str] = set()
        user = ScriptedUser(s)
        is_handled = lambda intent: intent["request"] in handled  # noqa: E731
        assert user.reply("Anything else?", is_handled).kind == "restate"
        handled.add(first["request"])
        turn = user.reply("Done. Anything else I can help with?", is_handled)
        assert (turn.text, turn.kind, turn.done) == (second["request"], "next_intent", False)
        assert "also" in turn.text.lower()
        # Now the user talks about the second intent.
        if second.get("order_id"):
            assert second["order_id"] in user.reply("Which order number?", is_handled).text
        handled.add(second["request"])
        assert user.reply("All set. Anything else I can help with?", is_handled).done


def test_read_intent_is_handled_when_the_agent_says_the_info():
    task = make_task("order_status", 9)
    episode = ENV.start(task)
    intent = task.scenario["intents"][0]
    status, total = intent["must_say"]
    reply, done = episode.user_reply(f"Your order is {status}. Anything else I can help with?")
    assert not done and reply == intent["request"]  # the total is still missing
    reply, done = episode.user_reply(f"The total was {total}. Anything else I can help with?")
    assert done and reply == DONE


def test_turn_cap_ends_the_conversation():
    task = make_task("cancel_pending", 0)
    episode = RetailEnv(max_user_turns=3).start(task)
    assert [episode.user_reply("Hmm.")[1] for _ in range(4)] == [False, False, False, True]
    assert episode.result().info["user_done"]


def test_user_is_deterministic():
    s = make_task("cancel_and_return", 2).scenario
    script = ["Please give me your email.", "Do you confirm? (yes/no)", "Anything else?", "Which order?"]
    runs = []
    for _ in range(2):
        user = ScriptedUser(s)
        runs.append([user.reply(text, HANDLED) for text in script])
    assert runs[0] == runs[1]
