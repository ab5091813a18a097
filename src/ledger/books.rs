//! The bank check against what the clients were told (Jepsen's bank test): `walletlock audit
//! --acks FILE`, the one check that the load test (`loadtest/run`) and the test suite run after
//! their loads.
//!
//! The clients write what each of them was told, one acknowledgement a line ([`Ack`], JSON): each
//! operation whose outcome they did not learn as [`Undecided`], which `--settle` decides by sending
//! the request again with its key (as a client would) before anything is checked;
//! the wallets they opened and with what, each movement applied (each leg's wallet, signed amount
//! and ledger entry), each one refused (nothing applied), and each hold placed and what became of
//! it. The check reads the ledger and holds them against it: every wallet's balance is its opening
//! balance plus the legs acknowledged on it; every acknowledged leg is in its
//! wallet's ledger once, as told, and the ledger has nothing else (no movement applied that no
//! client was told of, none applied twice); no movement told refused is stored as applied; every
//! hold is as its client was told. `walletlock audit` checks the ledger's own consistency beside
//! it (the chains, the transfers' legs, the holds, the keys).

use super::StoreError;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use std::collections::{BTreeMap, HashMap, HashSet};
use uuid::Uuid;

/// What one client was told, as one line of the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "ack", rename_all = "snake_case")]
pub enum Ack {
    /// A wallet the load opened, with its opening balance.
    Opened { wallet: String, balance: i64 },
    /// A movement applied (a deposit, a payment, a capture, a transfer, a movement of many legs):
    /// each leg as the answer reported it, by its ledger entry, or by the movement's id
    /// (`movement`: a transfer's or a movement's, which its legs carry).
    Applied {
        key: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        movement: Option<Uuid>,
        legs: Vec<AckLeg>,
    },
    /// A movement answered as not applied (a refusal, or a 503 that applied nothing).
    Refused { key: String },
    /// A hold placed, and what became of it as its client was last told: `captured` (with the
    /// amount charged and its entry, also acknowledged as applied), `voided`, or `expired` (left
    /// alone, or its capture or void refused too late). Checked once every hold left alone has
    /// expired.
    Hold { hold: Uuid, wallet: String, amount: i64, told: HoldTold },
    /// An operation whose answer its client never saw: settle it first (`--settle`).
    Undecided(Undecided),
}

/// An operation whose outcome its client never learned (no answer, or one that leaves it open):
/// its key, its kind (`pay`, `deposit`, `transfer`, `split`, `hold`, `capture`, `void`) and its
/// request, a POST of `body` (none: empty) to `path`, to send again with the key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Undecided {
    pub key: String,
    pub op: String,
    pub path: String,
    #[serde(default)]
    pub body: Option<String>,
}

/// What the answer to an undecided operation told its client: its acknowledgement (none for a
/// void, which moves no money), and what became of the hold it captured or voided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answered {
    pub ack: Option<Ack>,
    pub hold: Option<(Uuid, HoldTold)>,
}

impl Undecided {
    /// What `status` and `body`, the answer to the request sent again with its key, tell: `None`
    /// while they leave it undecided (no answer, in flight, a 5xx that may have applied it).
    pub fn settled(&self, status: u16, body: &serde_json::Value) -> Option<Answered> {
        let applied = |legs| Answered {
            ack: Some(Ack::Applied { key: self.key.clone(), movement: None, legs }),
            hold: None,
        };
        let code = body["code"].as_str().unwrap_or("");
        Some(match (self.op.as_str(), status) {
            ("hold", 201) => Answered {
                ack: Some(Ack::Hold {
                    hold: uuid(&body["id"])?,
                    wallet: body["wallet_id"].as_str()?.to_owned(),
                    amount: body["amount"].as_i64()?,
                    told: HoldTold::Expired,
                }),
                hold: None,
            },
            ("capture", 200) => {
                let leg = leg(&body["entry"])?;
                let told = HoldTold::Captured { amount: body["captured"].as_i64()?, entry: leg.entry? };
                Answered { hold: Some((uuid(&body["id"])?, told)), ..applied(vec![leg]) }
            }
            ("void", 200) => Answered { ack: None, hold: Some((uuid(&body["id"])?, HoldTold::Voided)) },
            ("transfer", 200) => applied(vec![leg(&body["from_entry"])?, leg(&body["to_entry"])?]),
            ("split", 201) => applied(body["legs"].as_array()?.iter().map(leg).collect::<Option<_>>()?),
            ("pay" | "deposit", 200) => applied(vec![leg(body)?]),
            // Nothing applied, and the API says so.
            (_, 400..=499) if code != "idempotency_key_in_flight" => refused(&self.key),
            (_, 503) if matches!(code, "lock_timeout" | "overloaded" | "dependency_unavailable") => {
                refused(&self.key)
            }
            _ => return None,
        })
    }
}

fn refused(key: &str) -> Answered {
    Answered { ack: Some(Ack::Refused { key: key.to_owned() }), hold: None }
}

fn uuid(value: &serde_json::Value) -> Option<Uuid> {
    value.as_str()?.parse().ok()
}

/// The leg an entry of an answer (`wallet_id`, `kind`, `amount`, `id`) acknowledges.
fn leg(entry: &serde_json::Value) -> Option<AckLeg> {
    Some(AckLeg {
        wallet: entry["wallet_id"].as_str()?.to_owned(),
        amount: signed(entry["kind"].as_str()?, entry["amount"].as_i64()?),
        entry: Some(uuid(&entry["id"])?),
    })
}

/// What an entry of `kind` and `amount` does to its wallet's balance.
fn signed(kind: &str, amount: i64) -> i64 {
    if matches!(kind, "pay" | "transfer_out") { -amount } else { amount }
}

/// How many holds `acks` tells of: placed, then captured, voided and expired.
pub fn holds_told(acks: &[Ack]) -> [usize; 4] {
    let mut told = [0; 4];
    for ack in acks {
        if let Ack::Hold { told: as_told, .. } = ack {
            told[0] += 1;
            told[match as_told {
                HoldTold::Captured { .. } => 1,
                HoldTold::Voided => 2,
                HoldTold::Expired => 3,
            }] += 1;
        }
    }
    told
}

/// One leg of an applied movement: money into (`amount` > 0) or out of its wallet, and its
/// ledger entry if the answer reported it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AckLeg {
    pub wallet: String,
    pub amount: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry: Option<Uuid>,
}

/// What a client was told became of a hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "as", rename_all = "snake_case")]
pub enum HoldTold {
    Captured { amount: i64, entry: Uuid },
    Voided,
    Expired,
}

/// What the check found: the problems, and the tutorial's totals over the load's wallets.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Books {
    pub wallets: usize,
    /// Movements acknowledged as applied.
    pub accepted: usize,
    /// The wallets' balances, summed, and what the acknowledgements make them.
    pub balance: i64,
    pub expected: i64,
    pub problems: Vec<String>,
}

impl Books {
    /// The tutorial's line: `accepted=N balance=B expected=E OK|BROKEN`.
    pub fn verdict(&self) -> String {
        let ok = if self.problems.is_empty() { "OK" } else { "BROKEN" };
        format!("accepted={} balance={} expected={} {ok}", self.accepted, self.balance, self.expected)
    }
}

/// One ledger entry, as the check compares it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct EntryRow {
    pub id: Uuid,
    pub kind: String,
    pub amount: i64,
    /// The transfer or movement it is a leg of.
    pub transfer_id: Option<Uuid>,
}

impl EntryRow {
    /// What the entry did to its wallet's balance.
    fn signed(&self) -> i64 {
        signed(&self.kind, self.amount)
    }
}

/// A hold as stored, as the check compares it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct HoldRow {
    pub id: Uuid,
    pub wallet_id: String,
    pub amount: i64,
    pub status: String,
    pub captured: i64,
    pub capture_entry: Option<Uuid>,
    pub expires_at: DateTime<Utc>,
}

/// The ledger as the check reads it for the acknowledged wallets, holds and keys.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Each wallet's balance, and its entries in order (its `open` entry first).
    pub wallets: HashMap<String, (i64, Vec<EntryRow>)>,
    pub holds: HashMap<Uuid, HoldRow>,
    /// The keys, among those told refused, whose stored response is a success.
    pub applied_keys: HashSet<String>,
    /// When the holds are judged: one still held past its expiry counts as expired.
    pub now: DateTime<Utc>,
}

/// Reads the acknowledgements of `text`, one JSON object a line (blank lines skipped).
pub fn parse(text: &str) -> Result<Vec<Ack>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(n, line)| serde_json::from_str(line).map_err(|err| format!("line {}: {err}", n + 1)))
        .collect()
}

/// Reads from the database what checking `acks` needs.
pub async fn read(conn: &mut PgConnection, acks: &[Ack]) -> Result<Ledger, StoreError> {
    let wallets: Vec<&str> = acks
        .iter()
        .filter_map(|ack| match ack {
            Ack::Opened { wallet, .. } => Some(wallet.as_str()),
            _ => None,
        })
        .collect();
    let refused: Vec<&str> = acks
        .iter()
        .filter_map(|ack| match ack {
            Ack::Refused { key } => Some(key.as_str()),
            _ => None,
        })
        .collect();
    let holds: Vec<Uuid> = acks
        .iter()
        .filter_map(|ack| match ack {
            Ack::Hold { hold, .. } => Some(*hold),
            _ => None,
        })
        .collect();
    let mut ledger = Ledger { now: Utc::now(), ..Ledger::default() };
    let balances: Vec<(String, i64)> = sqlx::query_as("select id, balance from wallet where id = any($1)")
        .bind(&wallets)
        .fetch_all(&mut *conn)
        .await?;
    for (id, balance) in balances {
        ledger.wallets.insert(id, (balance, Vec::new()));
    }
    let entries: Vec<(String, Uuid, String, i64, Option<Uuid>)> = sqlx::query_as(
        // language=PostgreSQL
        "select wallet_id, id, kind, amount, transfer_id from ledger_entry where wallet_id = any($1)
         order by wallet_id, seq",
    )
    .bind(&wallets)
    .fetch_all(&mut *conn)
    .await?;
    for (wallet, id, kind, amount, transfer_id) in entries {
        if let Some((_, entries)) = ledger.wallets.get_mut(&wallet) {
            entries.push(EntryRow { id, kind, amount, transfer_id });
        }
    }
    let holds: Vec<HoldRow> = sqlx::query_as(
        // language=PostgreSQL
        "select id, wallet_id, amount, status, captured, capture_entry, expires_at from hold where id = any($1)",
    )
    .bind(&holds)
    .fetch_all(&mut *conn)
    .await?;
    ledger.holds = holds.into_iter().map(|hold| (hold.id, hold)).collect();
    ledger.applied_keys = sqlx::query_scalar(
        // language=PostgreSQL
        "select key from idempotency_key where key = any($1) and status between 200 and 299",
    )
    .bind(&refused)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .collect();
    Ok(ledger)
}

/// When the last hold of `acks` that its client was told expired, and that is still held, expires.
pub async fn last_expiry(conn: &mut PgConnection, acks: &[Ack]) -> Result<Option<DateTime<Utc>>, StoreError> {
    let holds: Vec<Uuid> = acks
        .iter()
        .filter_map(|ack| match ack {
            Ack::Hold { hold, told: HoldTold::Expired, .. } => Some(*hold),
            _ => None,
        })
        .collect();
    Ok(sqlx::query_scalar("select max(expires_at) from hold where id = any($1) and status = 'held'")
        .bind(&holds)
        .fetch_one(conn)
        .await?)
}

/// Holds `ledger` against `acks` (see the module doc).
pub fn check(acks: &[Ack], ledger: &Ledger) -> Books {
    let mut books = Books::default();
    let mut opening: BTreeMap<&str, i64> = BTreeMap::new();
    // The legs acknowledged on each wallet, each with its movement's key and id.
    let mut legs: HashMap<&str, Vec<Told<'_>>> = HashMap::new();
    let mut told_entries: HashSet<Uuid> = HashSet::new();
    let mut told_movements: HashSet<Uuid> = HashSet::new();
    for ack in acks {
        match ack {
            Ack::Opened { wallet, balance } => {
                if opening.insert(wallet, *balance).is_some() {
                    books.problems.push(format!("wallet {wallet}: opened twice in the acknowledgements"));
                }
            }
            Ack::Applied { key, movement, legs: applied } => {
                books.accepted += 1;
                if let Some(movement) = movement
                    && !told_movements.insert(*movement)
                {
                    books.problems.push(format!("{key}: movement {movement} acknowledged twice"));
                }
                for leg in applied {
                    if let Some(entry) = leg.entry
                        && !told_entries.insert(entry)
                    {
                        books.problems.push(format!("{key}: entry {entry} acknowledged twice"));
                    }
                    legs.entry(leg.wallet.as_str()).or_default().push(Told { key, movement: *movement, leg });
                }
            }
            Ack::Refused { key } if ledger.applied_keys.contains(key) => {
                books.problems.push(format!("{key}: refused to its client, but stored as applied"));
            }
            Ack::Refused { .. } => {}
            Ack::Hold { hold, wallet, amount, told } => {
                books.problems.extend(check_hold(*hold, wallet, *amount, *told, ledger))
            }
            Ack::Undecided(op) => {
                books.problems.push(format!("{}: undecided (its answer never seen): settle it first", op.key))
            }
        }
    }
    for wallet in legs.keys().filter(|wallet| !opening.contains_key(*wallet)) {
        books.problems.push(format!("wallet {wallet}: a movement on it, but the load did not open it"));
    }
    books.wallets = opening.len();
    for (wallet, opened) in opening {
        let told = legs.get(wallet).map(Vec::as_slice).unwrap_or_default();
        let expected = opened + told.iter().map(|told| told.leg.amount).sum::<i64>();
        books.expected += expected;
        let Some((balance, entries)) = ledger.wallets.get(wallet) else {
            books.problems.push(format!("wallet {wallet}: opened with {opened}, but not in the ledger"));
            continue;
        };
        books.balance += balance;
        books.problems.extend(check_wallet(wallet, opened, told, *balance, entries, expected));
    }
    books
}

/// A leg as told, with its movement's key and id.
#[derive(Debug, Clone, Copy)]
struct Told<'a> {
    key: &'a str,
    movement: Option<Uuid>,
    leg: &'a AckLeg,
}

/// One wallet's books: its balance, and its ledger against the legs told on it.
fn check_wallet(
    wallet: &str,
    opened: i64,
    told: &[Told<'_>],
    balance: i64,
    entries: &[EntryRow],
    expected: i64,
) -> Vec<String> {
    // (Its floor, zero or its overdraft, is the audit's to check, which runs with this one.)
    let mut problems = Vec::new();
    if balance != expected {
        problems.push(format!(
            "wallet {wallet}: balance {balance} but expected {expected} (opened with {opened}; {} legs acknowledged)",
            told.len()
        ));
    }
    match entries.first() {
        Some(first) if first.kind == "open" && first.amount == opened => {}
        _ => {
            problems.push(format!("wallet {wallet}: the ledger does not open with the acknowledged {opened}"))
        }
    }
    let by_id: HashMap<Uuid, &EntryRow> = entries.iter().map(|entry| (entry.id, entry)).collect();
    let by_movement: HashMap<Uuid, &EntryRow> =
        entries.iter().filter_map(|entry| Some((entry.transfer_id?, entry))).collect();
    for Told { key, movement, leg } in told {
        let found = match (leg.entry, movement) {
            (Some(entry), _) => by_id.get(&entry),
            (None, Some(movement)) => by_movement.get(movement),
            (None, None) => None,
        };
        let named = match (leg.entry, movement) {
            (Some(entry), _) => format!("entry {entry}"),
            (None, Some(movement)) => format!("of movement {movement}"),
            (None, None) => "named by nothing".to_owned(),
        };
        match found {
            None => problems.push(format!("wallet {wallet}: {key}'s leg ({named}) is not in the ledger")),
            Some(entry) if entry.signed() != leg.amount => problems.push(format!(
                "wallet {wallet}: {key}'s leg of {:+} is a {} of {} in the ledger",
                leg.amount, entry.kind, entry.amount
            )),
            Some(_) => {}
        }
    }
    let moved = entries.iter().filter(|entry| entry.kind != "open").count();
    if moved != told.len() {
        problems.push(format!(
            "wallet {wallet}: {moved} entries besides its opening in the ledger, {} acknowledged",
            told.len()
        ));
    }
    problems
}

/// One hold as stored, against what its client was told.
fn check_hold(id: Uuid, wallet: &str, amount: i64, told: HoldTold, ledger: &Ledger) -> Vec<String> {
    let Some(hold) = ledger.holds.get(&id) else {
        return vec![format!("hold {id}: placed for its client, but not stored")];
    };
    let expired = hold.status == "expired" || (hold.status == "held" && hold.expires_at <= ledger.now);
    let as_told = hold.wallet_id == wallet
        && hold.amount == amount
        && match told {
            HoldTold::Captured { amount, entry } => {
                hold.status == "captured" && hold.captured == amount && hold.capture_entry == Some(entry)
            }
            HoldTold::Voided => hold.status == "voided",
            HoldTold::Expired => expired,
        };
    if as_told {
        return Vec::new();
    }
    vec![format!(
        "hold {id} (wallet {}, {}): {} (captured {}), but its client was told {told:?} (wallet {wallet}, {amount})",
        hold.wallet_id, hold.amount, hold.status, hold.captured
    )]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(kind: &str, amount: i64) -> EntryRow {
        EntryRow { id: Uuid::new_v4(), kind: kind.to_owned(), amount, transfer_id: None }
    }

    fn applied(key: &str, legs: &[(&str, i64, Uuid)]) -> Ack {
        let legs = legs
            .iter()
            .map(|&(wallet, amount, entry)| AckLeg { wallet: wallet.to_owned(), amount, entry: Some(entry) })
            .collect();
        Ack::Applied { key: key.to_owned(), movement: None, legs }
    }

    /// Two wallets opened with 100 and 0, a payment of 30 out of `a`, a transfer of 20 from `a` to
    /// `b`: the acknowledgements and the ledger that matches them.
    fn sample() -> (Vec<Ack>, Ledger) {
        let (pay, out, into) = (entry("pay", 30), entry("transfer_out", 20), entry("transfer_in", 20));
        let acks = vec![
            Ack::Opened { wallet: "a".into(), balance: 100 },
            Ack::Opened { wallet: "b".into(), balance: 0 },
            applied("k-pay", &[("a", -30, pay.id)]),
            applied("k-transfer", &[("a", -20, out.id), ("b", 20, into.id)]),
            Ack::Refused { key: "k-refused".into() },
        ];
        let mut ledger = Ledger { now: Utc::now(), ..Ledger::default() };
        ledger.wallets.insert("a".into(), (50, vec![entry("open", 100), pay, out]));
        ledger.wallets.insert("b".into(), (20, vec![entry("open", 0), into]));
        (acks, ledger)
    }

    #[test]
    fn books_that_match_what_the_clients_were_told_are_ok() {
        let (acks, ledger) = sample();
        let books = check(&acks, &ledger);
        assert_eq!(books.problems, Vec::<String>::new());
        assert_eq!(books.verdict(), "accepted=2 balance=70 expected=70 OK");
    }

    #[test]
    fn an_applied_movement_no_client_was_told_of_breaks_the_books() {
        let (acks, mut ledger) = sample();
        let (balance, entries) = ledger.wallets.get_mut("a").unwrap();
        entries.push(entry("pay", 5));
        *balance -= 5;
        let books = check(&acks, &ledger);
        assert_eq!(books.problems.len(), 2, "{:?}", books.problems);
        assert!(books.problems[0].contains("balance 45 but expected 50"));
        assert!(books.problems[1].contains("3 entries besides its opening in the ledger, 2 acknowledged"));
        assert!(books.verdict().ends_with("BROKEN"));
    }

    #[test]
    fn an_acknowledged_leg_missing_or_changed_and_a_refusal_stored_as_applied_break_the_books() {
        let (acks, mut ledger) = sample();
        ledger.wallets.get_mut("b").unwrap().1[1].amount = 19;
        ledger.applied_keys.insert("k-refused".into());
        let books = check(&acks, &ledger);
        assert!(books.problems.iter().any(|p| p.contains("k-transfer's leg of +20 is a transfer_in of 19")));
        assert!(
            books
                .problems
                .iter()
                .any(|p| p.contains("k-refused: refused to its client, but stored as applied"))
        );

        let (mut acks, ledger) = sample();
        acks.push(applied("k-lost", &[("a", -1, Uuid::new_v4())]));
        let books = check(&acks, &ledger);
        assert!(
            books.problems.iter().any(|p| p.contains("k-lost's leg") && p.contains("is not in the ledger"))
        );
    }

    #[test]
    fn a_leg_is_found_by_its_movement_when_the_answer_named_no_entry() {
        let (mut acks, mut ledger) = sample();
        let movement = Uuid::new_v4();
        let (out, into) = (
            EntryRow { transfer_id: Some(movement), ..entry("transfer_out", 5) },
            EntryRow { transfer_id: Some(movement), ..entry("transfer_in", 5) },
        );
        for (wallet, leg) in [("a", out), ("b", into)] {
            let (balance, entries) = ledger.wallets.get_mut(wallet).unwrap();
            *balance += leg.signed();
            entries.push(leg);
        }
        let legs = [("a", -5), ("b", 5)]
            .map(|(wallet, amount)| AckLeg { wallet: wallet.into(), amount, entry: None })
            .to_vec();
        acks.push(Ack::Applied { key: "k-split".into(), movement: Some(movement), legs: legs.clone() });
        assert_eq!(check(&acks, &ledger).problems, Vec::<String>::new());
        acks.push(Ack::Applied { key: "k-again".into(), movement: Some(movement), legs });
        assert!(check(&acks, &ledger).problems.iter().any(|p| p.contains("acknowledged twice")));
    }

    #[test]
    fn a_hold_is_as_its_client_was_told_and_one_held_past_its_expiry_counts_as_expired() {
        let (mut acks, mut ledger) = sample();
        let stored = |status: &str, expires_in: i64| HoldRow {
            id: Uuid::new_v4(),
            wallet_id: "a".into(),
            amount: 10,
            status: status.into(),
            captured: 0,
            capture_entry: None,
            expires_at: ledger.now + chrono::Duration::seconds(expires_in),
        };
        let (lapsed, pending, voided) = (stored("held", -1), stored("held", 60), stored("voided", 60));
        for (hold, told) in
            [(&lapsed, HoldTold::Expired), (&pending, HoldTold::Expired), (&voided, HoldTold::Expired)]
        {
            acks.push(Ack::Hold { hold: hold.id, wallet: "a".into(), amount: 10, told });
        }
        for hold in [lapsed, pending.clone(), voided.clone()] {
            ledger.holds.insert(hold.id, hold);
        }
        let books = check(&acks, &ledger);
        assert_eq!(books.problems.len(), 2, "{:?}", books.problems);
        assert!(books.problems.iter().any(|p| p.starts_with(&format!("hold {}", pending.id))));
        assert!(books.problems.iter().any(|p| p.starts_with(&format!("hold {}", voided.id))));
    }

    #[test]
    fn an_undecided_operation_is_what_the_answer_to_its_key_then_tells() {
        use serde_json::json;
        let op = |op: &str| Undecided { key: "k".into(), op: op.into(), path: "/p".into(), body: None };
        let (hold, entry) = (Uuid::new_v4(), Uuid::new_v4());
        let pay = json!({ "id": entry, "wallet_id": "a", "kind": "pay", "amount": 30 });
        let leg = AckLeg { wallet: "a".into(), amount: -30, entry: Some(entry) };
        let applied = Some(Ack::Applied { key: "k".into(), movement: None, legs: vec![leg.clone()] });
        assert_eq!(op("pay").settled(200, &pay), Some(Answered { ack: applied.clone(), hold: None }));
        let captured = json!({ "id": hold, "wallet_id": "a", "captured": 30, "entry": pay });
        let told = HoldTold::Captured { amount: 30, entry };
        assert_eq!(
            op("capture").settled(200, &captured),
            Some(Answered { ack: applied, hold: Some((hold, told)) })
        );
        assert_eq!(
            op("void").settled(200, &json!({ "id": hold })),
            Some(Answered { ack: None, hold: Some((hold, HoldTold::Voided)) })
        );
        let placed = json!({ "id": hold, "wallet_id": "a", "amount": 5, "status": "held" });
        let expired = Ack::Hold { hold, wallet: "a".into(), amount: 5, told: HoldTold::Expired };
        assert_eq!(op("hold").settled(201, &placed).unwrap().ack, Some(expired));
        let into = json!({ "id": Uuid::new_v4(), "wallet_id": "b", "kind": "transfer_in", "amount": 30 });
        let Some(Ack::Applied { legs, .. }) =
            op("split").settled(201, &json!({ "legs": [pay, into] })).and_then(|settled| settled.ack)
        else {
            panic!("a split applied")
        };
        assert_eq!(legs.iter().map(|leg| leg.amount).collect::<Vec<_>>(), [-30, 30]);

        let refused = Some(Answered { ack: Some(Ack::Refused { key: "k".into() }), hold: None });
        assert_eq!(op("pay").settled(422, &json!({ "code": "insufficient_funds" })), refused);
        assert_eq!(op("pay").settled(503, &json!({ "code": "lock_timeout" })), refused);
        for (status, code) in
            [(409, "idempotency_key_in_flight"), (503, "request_timeout"), (502, ""), (0, "")]
        {
            assert_eq!(op("pay").settled(status, &json!({ "code": code })), None, "{status} {code}");
        }
    }

    #[test]
    fn an_undecided_operation_left_unsettled_breaks_the_books() {
        let (mut acks, ledger) = sample();
        acks.push(Ack::Undecided(Undecided {
            key: "k-open".into(),
            op: "pay".into(),
            path: "/p".into(),
            body: None,
        }));
        assert!(check(&acks, &ledger).problems.iter().any(|p| p.starts_with("k-open: undecided")));
        let line = r#"{"ack":"undecided","key":"k","op":"void","path":"/holds/h/void","body":null}"#;
        assert!(matches!(&parse(line).unwrap()[0], Ack::Undecided(Undecided { body: None, .. })));
    }

    #[test]
    fn acknowledgements_are_read_a_line_each() {
        let text = concat!(
            r#"{"ack":"opened","wallet":"a","balance":100}"#,
            "\n\n",
            r#"{"ack":"applied","key":"k","legs":[{"wallet":"a","amount":-30,"entry":"0192f0a0-0000-7000-8000-000000000001"}]}"#,
            "\n",
            r#"{"ack":"hold","hold":"0192f0a0-0000-7000-8000-000000000002","wallet":"a","amount":5,"told":{"as":"voided"}}"#,
            "\n"
        );
        let acks = parse(text).unwrap();
        assert_eq!(acks.len(), 3);
        assert!(matches!(&acks[2], Ack::Hold { told: HoldTold::Voided, .. }));
        assert!(parse("{\"ack\":\"opened\"}\n").unwrap_err().starts_with("line 1:"));
    }
}
