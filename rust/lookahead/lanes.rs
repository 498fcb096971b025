//! The per-sequence work of a job: a leader's lane inserts its flushed tokens, selects and
//! plans; a follower's lane appends its flush to its history and rewrites the pages its
//! leader's insert changed.

use std::time::Instant;

use half::{bf16, f16};

use super::{secs, Elem, Flush, FollowerLane, Geometry, HostBuf, LanePlan, LeaderLane};
use crate::error::{ensure, Error, Result};
use crate::load::LoadPlan;
use crate::pages::{int8, HeadForest, PageFormat};
use crate::select::SelectParams;

/// What a leader's lane did: its plan, and the seconds spent inserting and selecting.
pub(super) struct LeaderWork {
    pub plan: LanePlan,
    pub insert_s: f64,
    pub select_s: f64,
}

/// Inserts, selects and plans for one leader sequence.
pub(super) fn leader_lane(
    g: &Geometry,
    lane: &LeaderLane,
    q: &[f32],
    select: SelectParams,
    reselect: bool,
) -> Result<LeaderWork> {
    let h = g.heads;
    let width = select.max_pages;
    let capacity = lane.resident.read().map_err(|_| poisoned())?.capacity();
    let nothing = || LanePlan {
        plan: LoadPlan { table: vec![-1; h * width], ..LoadPlan::default() },
        table_len: vec![0; h * width],
        selected: vec![-1; h * width],
        changed: vec![Vec::new(); h],
        capacity,
        ..LanePlan::default()
    };
    let Some(lane_forest) = &lane.forest else {
        ensure!(lane.flush.is_none(), "tokens were flushed into a sequence that has no index yet");
        return Ok(LeaderWork { plan: nothing(), insert_s: 0.0, select_s: 0.0 });
    };
    if !reselect && lane.flush.is_none() {
        return Ok(LeaderWork { plan: nothing(), insert_s: 0.0, select_s: 0.0 });
    }
    let t = Instant::now();
    let mut changed = vec![Vec::new(); h];
    if let Some(flush) = &lane.flush {
        let mut forest = lane_forest.write().map_err(|_| poisoned())?;
        check_store_dims(g, &forest)?;
        let pages = insert_flush(g, &mut forest, flush, lane.k_store, lane.v_store)?;
        let mut resident = lane.resident.write().map_err(|_| poisoned())?;
        for (head, pages) in pages.into_iter().enumerate() {
            let ids: Vec<i64> = pages.iter().map(|&p| p as i64).collect();
            resident.invalidate(head, &ids)?;
            changed[head] = pages
                .into_iter()
                .map(|p| Ok((p, forest.page_tokens(head, p as usize)?.to_vec())))
                .collect::<Result<_>>()?;
        }
    }
    let insert_s = secs(t);
    let t = Instant::now();
    let forest = lane_forest.read().map_err(|_| poisoned())?;
    check_store_dims(g, &forest)?;
    let (pages, counts) = if forest.max_pages() <= width {
        // Everything fits: every page, no search (and exact).
        let mut pages = vec![-1i32; h * width];
        let mut counts = vec![0i32; h];
        for head in 0..h {
            let n = forest.num_pages(head)?;
            for (p, o) in pages[head * width..head * width + n].iter_mut().enumerate() {
                *o = p as i32;
            }
            counts[head] = n as i32;
        }
        (pages, counts)
    } else {
        // An 8-bit forest's keys are its K store's rows.
        let k_codes = match g.format {
            PageFormat::Native => None,
            PageFormat::Int8 => Some(lane.k_store.slice::<u8>("k_store")?),
        };
        forest.select(q, select, k_codes)?
    };
    let plan = lane.resident.write().map_err(|_| poisoned())?.plan(&pages, &counts)?;
    let len =
        |head: i32, page: i32| -> Result<i32> { Ok(forest.page_tokens(head as usize, page as usize)?.len() as i32) };
    let load_len = plan.heads.iter().zip(&plan.pages).map(|(&hd, &p)| len(hd, p)).collect::<Result<Vec<_>>>()?;
    let mut table_len = vec![0i32; h * width];
    for (i, (&p, tl)) in pages.iter().zip(table_len.iter_mut()).enumerate() {
        if p >= 0 {
            *tl = len((i / width) as i32, p)?;
        }
    }
    let plan = LanePlan { plan, load_len, table_len, selected: pages, changed, capacity };
    Ok(LeaderWork { plan, insert_s, select_s: secs(t) })
}

pub(super) fn poisoned() -> Error {
    Error::Invalid("an earlier failure left this layer's index unusable; reset the cache".into())
}

fn check_store_dims(g: &Geometry, forest: &HeadForest) -> Result<()> {
    ensure!(
        forest.num_heads() == g.heads && forest.dim() == g.dim && forest.page_size() == g.page_size,
        "the index has {} heads of dim {} with pages of {}, the job {} / {} / {}",
        forest.num_heads(),
        forest.dim(),
        forest.page_size(),
        g.heads,
        g.dim,
        g.page_size
    );
    Ok(())
}

/// `forest.insert` for the job's element type; returns the changed pages per head.
fn insert_flush(
    g: &Geometry,
    forest: &mut HeadForest,
    flush: &Flush,
    k_store: HostBuf,
    v_store: HostBuf,
) -> Result<Vec<Vec<u32>>> {
    let want = g.heads * flush.tokens * g.dim;
    macro_rules! typed {
        ($t:ty) => {{
            let k = flush.keys.slice::<$t>("flushed keys")?;
            let v = flush.values.slice::<$t>("flushed values")?;
            ensure!(
                k.len() == want && v.len() == want,
                "flushed keys/values must be [{}, {}, {}]",
                g.heads,
                flush.tokens,
                g.dim
            );
            match g.format {
                PageFormat::Native => {
                    forest.insert(k, v, k_store.slice_mut::<$t>("k_store")?, v_store.slice_mut::<$t>("v_store")?)
                }
                PageFormat::Int8 => {
                    forest.insert_int8(k, v, k_store.slice_mut::<u8>("k_store")?, v_store.slice_mut::<u8>("v_store")?)
                }
            }
        }};
    }
    match g.elem {
        Elem::F32 => typed!(f32),
        Elem::F16 => typed!(f16),
        Elem::Bf16 => typed!(u16),
    }
}

/// A follower sequence: appends the flush to its history and rewrites the pages its leader's
/// insert changed, from the history (as bytes: every element type alike; 8-bit pages quantise
/// the rows).
pub(super) fn follow_lane(g: &Geometry, lane: &FollowerLane, lead: &LanePlan) -> Result<()> {
    let rb = g.row_bytes();
    let hk = lane.k_history.slice_mut::<u8>("k_history")?;
    let hv = lane.v_history.slice_mut::<u8>("v_history")?;
    ensure!(
        hk.len() == hv.len() && hk.len() % (g.heads * rb) == 0,
        "histories must both be [{}, n, {}]",
        g.heads,
        g.dim
    );
    let cap = hk.len() / (g.heads * rb);
    ensure!(lane.history_len <= cap, "history_len {} exceeds the history's {cap} tokens", lane.history_len);
    if let Some(f) = &lane.flush {
        let (k, v) = (f.keys.slice::<u8>("flushed keys")?, f.values.slice::<u8>("flushed values")?);
        ensure!(
            k.len() == g.heads * f.tokens * rb && v.len() == k.len(),
            "flushed keys/values must be [{}, {}, {}]",
            g.heads,
            f.tokens,
            g.dim
        );
        ensure!(
            f.tokens <= lane.history_len,
            "history_len {} is below the {} flushed tokens",
            lane.history_len,
            f.tokens
        );
        let at = lane.history_len - f.tokens;
        for head in 0..g.heads {
            let dst = (head * cap + at) * rb;
            let src = head * f.tokens * rb;
            hk[dst..dst + f.tokens * rb].copy_from_slice(&k[src..src + f.tokens * rb]);
            hv[dst..dst + f.tokens * rb].copy_from_slice(&v[src..src + f.tokens * rb]);
        }
    }
    let ks = lane.k_store.slice_mut::<u8>("k_store")?;
    let vs = lane.v_store.slice_mut::<u8>("v_store")?;
    let pb = g.page_bytes();
    ensure!(
        ks.len() == vs.len() && ks.len() % (g.heads * pb) == 0,
        "stores must both be [{}, P] pages of {pb} bytes",
        g.heads
    );
    let p = ks.len() / (g.heads * pb);
    for (head, pages) in lead.changed.iter().enumerate() {
        for (page, tokens) in pages {
            ensure!((*page as usize) < p, "page {page} beyond the store's {p} pages");
            let at = (head * p + *page as usize) * pb;
            let (kp, vp) = (&mut ks[at..at + pb], &mut vs[at..at + pb]);
            kp.fill(0);
            vp.fill(0);
            ensure!(tokens.len() <= g.page_size, "page {page} holds more than {} tokens", g.page_size);
            for (slot, &t) in tokens.iter().enumerate() {
                ensure!((t as usize) < lane.history_len, "token {t} is not in the history ({})", lane.history_len);
                let src = (head * cap + t as usize) * rb;
                let (k, v) = (&hk[src..src + rb], &hv[src..src + rb]);
                match g.format {
                    PageFormat::Native => {
                        kp[slot * rb..(slot + 1) * rb].copy_from_slice(k);
                        vp[slot * rb..(slot + 1) * rb].copy_from_slice(v);
                    }
                    PageFormat::Int8 => {
                        for (page, row) in [(&mut *kp, k), (&mut *vp, v)] {
                            let row = row_f32(g.elem, row);
                            ensure!(row.iter().all(|x| x.is_finite()), "8-bit pages hold finite values only");
                            int8::put_row(page, slot, &row, g.page_size);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// A history row's bytes as f32 values.
fn row_f32(elem: Elem, bytes: &[u8]) -> Vec<f32> {
    match elem {
        Elem::F32 => bytes.chunks_exact(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Elem::F16 => bytes.chunks_exact(2).map(|b| f16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f32()).collect(),
        Elem::Bf16 => {
            bytes.chunks_exact(2).map(|b| bf16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f32()).collect()
        }
    }
}
