//! Element types and reduction operators, with the numeric codes the Python side uses.

/// An element type the kernels reduce. The codes are part of the Python binding's contract
/// (`elastix.collectives.dtypes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    Bool = 0,
    I8 = 1,
    U8 = 2,
    I16 = 3,
    U16 = 4,
    I32 = 5,
    U32 = 6,
    I64 = 7,
    U64 = 8,
    F16 = 9,
    BF16 = 10,
    F32 = 11,
    F64 = 12,
}

impl DType {
    pub const ALL: [DType; 13] = [
        DType::Bool,
        DType::I8,
        DType::U8,
        DType::I16,
        DType::U16,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::I8 | DType::U8 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
}

/// A reduction operator. Averages are sums with a divisor (see [`crate::collectives::reduce`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum = 0,
    Product = 1,
    Min = 2,
    Max = 3,
    BitAnd = 4,
    BitOr = 5,
    BitXor = 6,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 7] = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::BitAnd,
        ReduceOp::BitOr,
        ReduceOp::BitXor,
    ];

    pub fn from_code(code: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.get(code as usize).copied()
    }

    pub fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for (code, dtype) in DType::ALL.iter().enumerate() {
            assert_eq!(DType::from_code(code as u8), Some(*dtype));
            assert_eq!(*dtype as usize, code);
        }
        for (code, op) in ReduceOp::ALL.iter().enumerate() {
            assert_eq!(ReduceOp::from_code(code as u8), Some(*op));
        }
        assert_eq!(DType::from_code(13), None);
        assert_eq!(ReduceOp::from_code(7), None);
    }
}
