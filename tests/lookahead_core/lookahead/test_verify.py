from lookahead_core.lookahead.verify import verify_greedy

# rows: 0 = last token, candidates of 3 tokens from row 1 on
CAND_START = 1


def test_no_candidates_gives_the_models_next_token():
    assert verify_greedy([42], [], CAND_START) == (-1, [42])


def test_full_match_accepts_n_tokens():
    # model: after last -> 5, after 5 -> 6, after 6 -> 7, after 7 -> 8
    preds = [5, 6, 7, 8]
    assert verify_greedy(preds, [(5, 6, 7)], CAND_START) == (0, [5, 6, 7, 8])


def test_first_token_mismatch_rejects_the_candidate():
    preds = [5, 0, 0, 0]
    assert verify_greedy(preds, [(4, 6, 7)], CAND_START) == (-1, [5])


def test_partial_match_takes_the_models_token_at_the_break():
    preds = [5, 6, 9, 0]
    assert verify_greedy(preds, [(5, 6, 7)], CAND_START) == (0, [5, 6, 9])


def test_longest_prefix_wins_over_earlier_shorter():
    preds = [5, 9, 0, 0] + [6, 7, 8]
    cands = [(5, 1, 1), (5, 6, 7)]
    assert verify_greedy(preds, cands, CAND_START) == (1, [5, 6, 7, 8])


def test_tie_keeps_the_first_candidate():
    preds = [5, 1, 0, 0] + [2, 0, 0]
    cands = [(5, 3, 3), (5, 4, 4)]
    assert verify_greedy(preds, cands, CAND_START) == (0, [5, 1])


def test_candidates_start_after_the_window():
    # 4 window rows between the last token and the candidates
    preds = [5, 0, 0, 0, 0, 6, 7]
    assert verify_greedy(preds, [(5, 6)], cand_start=5) == (0, [5, 6, 7])
