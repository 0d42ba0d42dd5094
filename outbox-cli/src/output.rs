//! Text output of the `outbox` command: the status tables (with the
//! progress mode's lanes and the transaction holding them back), lane lists
//! and ages for people.

use outbox_runtime::ops;

pub(crate) fn print_status(s: &ops::Status) {
    let age = |a: Option<f64>| a.map_or_else(|| "-".to_owned(), ops_age);
    // Estimated counts are marked `~` (see `Status::estimated` and
    // `Status::backlog_estimated`).
    let mark = |estimated: bool, n: i64| {
        if estimated {
            format!("~{n}")
        } else {
            n.to_string()
        }
    };
    let published = |n: i64| mark(s.estimated, n);
    let backlog = |n: i64| mark(s.backlog_estimated, n);
    let rows: Vec<[String; 8]> = s
        .topics
        .iter()
        .map(|t| {
            [
                t.topic.clone(),
                backlog(t.unpublished),
                backlog(t.held),
                backlog(t.scheduled),
                age(t.oldest_unpublished_secs),
                backlog(t.parked),
                backlog(t.discarded),
                published(t.published),
            ]
        })
        .chain(std::iter::once([
            "TOTAL".to_owned(),
            backlog(s.unpublished),
            backlog(s.held),
            backlog(s.scheduled.total),
            age(s.oldest_unpublished_secs),
            backlog(s.parked),
            backlog(s.discarded),
            published(s.published),
        ]))
        .collect();
    let header = [
        "TOPIC",
        "UNPUBLISHED",
        "HELD",
        "SCHEDULED",
        "OLDEST UNPUBLISHED",
        "PARKED",
        "DROPPED",
        "PUBLISHED",
    ];
    print!("{}", table(&header, &rows));
    if s.backlog_estimated {
        println!(
            "~ estimated: the backlog holds more than {} rows of a kind; per topic, the split \
             of the rows read first",
            ops::BACKLOG_EXACT_UP_TO
        );
    } else if s.estimated {
        println!("~ estimated from the table's statistics");
    }
    if let Some(next) = s.scheduled.next_due_secs {
        // Scheduled rows wait for their time apart from the backlog.
        if next >= 0.0 {
            println!("scheduled: next due in {}", ops_age(next));
        } else {
            println!(
                "scheduled: the next one is overdue by {} (no relay released it)",
                ops_age(-next)
            );
        }
    }
    if let Some(progress) = &s.progress {
        println!("progress mode: each lane's position and the events it has not passed");
        print_progress(progress);
    }
    println!("outbox: schema {}", s.schema);
    println!(
        "notify: {} (channel {})",
        if s.notify_enabled { "on" } else { "off" },
        s.channel
    );
    if s.relays.is_empty() {
        println!("relays: none running");
    } else {
        let rows: Vec<[String; 4]> = s
            .relays
            .iter()
            .map(|r| {
                [
                    r.pid.to_string(),
                    r.client.clone().unwrap_or_else(|| "local".into()),
                    r.lane_count.map_or_else(|| "-".into(), |c| c.to_string()),
                    if r.lane_count == Some(0) {
                        "all (no lanes)".into()
                    } else {
                        lane_list(&r.lanes)
                    },
                ]
            })
            .collect();
        print!(
            "{}",
            table(
                &["RELAY (PID)", "CLIENT", "LANE COUNT", "LANES OWNED"],
                &rows
            )
        );
    }
}

/// The progress mode's lanes (position, lag, oldest event) and the
/// transaction holding their windows back (`outbox status`, `outbox
/// progress status`).
pub(crate) fn print_progress(p: &ops::ProgressLag) {
    let more = |n: i64| {
        if n > ops::LAG_EXACT_UP_TO {
            format!(">{}", ops::LAG_EXACT_UP_TO)
        } else {
            n.to_string()
        }
    };
    // A lane by its number (its slots follow from the count); the single
    // position `enable` records is every slot's; another set by its slots.
    let rows: Vec<[String; 6]> = p
        .lanes
        .iter()
        .map(|l| {
            [
                match l.lane_count {
                    Some(1) => "all slots".into(),
                    Some(count) => format!("{} of {count}", l.lane),
                    None => l.slots.clone(),
                },
                more(l.events),
                l.oldest_secs.map_or_else(|| "-".into(), ops_age),
                l.after_id.map_or_else(|| "-".into(), |a| a.to_string()),
                ops_age(l.recorded_secs_ago),
                format!("{} .. {}", l.done, l.upto.as_deref().unwrap_or("(next)")),
            ]
        })
        .collect();
    let header = [
        "LANE",
        "LAG (EVENTS)",
        "OLDEST",
        "AFTER ID",
        "RECORDED",
        "WINDOW",
    ];
    print!("{}", table(&header, &rows));
    match &p.holding {
        None => println!("held back by: no transaction (none open in the lanes' snapshots)"),
        Some(h) => {
            let pid = h
                .pid
                .map_or_else(|| "no backend (prepared?)".into(), |p| format!("pid {p}"));
            let age = h.age_secs.map_or_else(
                || "open for an unknown time (needs pg_read_all_stats)".into(),
                |a| format!("open for {}", ops_age(a)),
            );
            let mut seen = Vec::new();
            if let Some(state) = &h.state {
                seen.push(state.clone());
            }
            if let Some(app) = h.application_name.as_deref().filter(|a| !a.is_empty()) {
                seen.push(format!("application {app}"));
            }
            if let Some(user) = &h.user {
                seen.push(format!("role {user}"));
            }
            let seen = if seen.is_empty() {
                String::new()
            } else {
                format!(", {}", seen.join(", "))
            };
            println!(
                "held back by: transaction {} ({pid}, {age}{seen}), in the snapshots of {} lane(s)",
                h.xid, h.lanes
            );
        }
    }
}

/// `0-5,9,12-13`, or "none".
fn lane_list(lanes: &[i32]) -> String {
    if lanes.is_empty() {
        "none".into()
    } else {
        ops::lane_ranges(lanes)
    }
}

/// An age for people: `850ms`, `42s`, `3m 12s`, `5h 02m`, `2d 03h`.
pub(crate) fn ops_age(secs: f64) -> String {
    let s = secs.max(0.0);
    if s < 1.0 {
        return format!("{:.0}ms", s * 1e3);
    }
    let s = s as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {:02}s", s / 60, s % 60),
        3600..86_400 => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {:02}h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// A text table: the first column left-aligned, the others right-aligned,
/// columns as wide as their widest cell.
pub(crate) fn table<const N: usize>(header: &[&str; N], rows: &[[String; N]]) -> String {
    let mut widths = header.map(str::len);
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[&str]| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i == 0 {
                out.push_str(&format!("{cell:<w$}"));
            } else {
                out.push_str(&format!("  {cell:>w$}"));
            }
        }
        out.trim_end().to_owned() + "\n"
    };
    let mut out = line(header);
    for row in rows {
        let cells: Vec<&str> = row.iter().map(String::as_str).collect();
        out.push_str(&line(&cells));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{lane_list, ops_age};

    #[test]
    fn lane_lists_collapse_runs() {
        assert_eq!(lane_list(&[]), "none");
        assert_eq!(lane_list(&[3]), "3");
        assert_eq!(lane_list(&[0, 1, 2, 3, 4, 5]), "0-5");
        assert_eq!(lane_list(&[0, 1, 2, 9, 12, 13]), "0-2,9,12-13");
    }

    #[test]
    fn ages_read_well() {
        assert_eq!(ops_age(0.25), "250ms");
        assert_eq!(ops_age(42.0), "42s");
        assert_eq!(ops_age(192.0), "3m 12s");
        assert_eq!(ops_age(5.0 * 3600.0 + 120.0), "5h 02m");
    }
}
